//! Recurrent-state slots of the batched engine: a hybrid (GatedDeltaNet) model's sequences each
//! hold one slot — the conv window and delta state of every GDN layer — beside their KV blocks.
//!
//! A slot is taken when a sequence first reserves blocks (or resumes from a checkpoint) and
//! given back with them (finish, cancel, preemption). A recurrent state cannot be rewound and a
//! KV block match says nothing of the recurrent state at its end, so prefix reuse for hybrid
//! models needs copies of the state taken at block boundaries: [`super::state_cache`] keeps them
//! (under their own byte budget; off by default), [`RecurrentSlots::snapshot`] takes one and
//! [`RecurrentSlots::restore`] puts one into a slot. Without one, a sequence that gives its slot
//! back recomputes from its first token.

use crate::model::{GdnState, LayerRecurrent, Model};

pub(crate) type SlotId = usize;

/// Every slot made so far; freed ones are cleared and handed out again.
pub(crate) struct RecurrentSlots {
    /// A fresh slot's layout: per layer, a state for a GDN layer, None for attention.
    template: Vec<Option<GdnState>>,
    slots: Vec<Vec<Option<GdnState>>>,
    free: Vec<SlotId>,
}

impl RecurrentSlots {
    pub fn new(model: &Model) -> RecurrentSlots {
        RecurrentSlots {
            template: model.recurrent_states(model.config.num_layers),
            slots: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Whether the model has recurrent layers (its sequences need slots).
    pub fn needed(&self) -> bool {
        self.template.iter().any(Option::is_some)
    }

    /// A slot holding the state before any token.
    pub fn allocate(&mut self) -> SlotId {
        match self.free.pop() {
            Some(id) => {
                self.slots[id]
                    .iter_mut()
                    .flatten()
                    .for_each(GdnState::clear);
                id
            }
            None => {
                self.slots.push(self.template.clone());
                self.slots.len() - 1
            }
        }
    }

    /// A slot holding a copy of slot `from`'s state (a forked sequence).
    pub fn fork(&mut self, from: SlotId) -> SlotId {
        let id = self.allocate();
        let (src, dst) = if from < id {
            let (a, b) = self.slots.split_at_mut(id);
            (&a[from], &mut b[0])
        } else {
            let (a, b) = self.slots.split_at_mut(from);
            (&b[0], &mut a[id])
        };
        dst.clone_from(src);
        id
    }

    pub fn release(&mut self, id: SlotId) {
        debug_assert!(!self.free.contains(&id), "slot {id} freed twice");
        self.free.push(id);
    }

    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether `id` is handed out (tests' bookkeeping check).
    pub fn is_held(&self, id: SlotId) -> bool {
        id < self.slots.len() && !self.free.contains(&id)
    }

    /// Bytes one slot occupies (fixed: it does not grow with the context).
    pub fn slot_bytes(&self) -> usize {
        self.template.iter().flatten().map(GdnState::bytes).sum()
    }

    /// A copy of every GDN layer's state in slot `id`, in layer order (a checkpoint).
    pub fn snapshot(&self, id: SlotId) -> Vec<GdnState> {
        self.slots[id].iter().flatten().cloned().collect()
    }

    /// Copies slot `id`'s states into `into` (a checkpoint kept up to date, its buffers reused).
    pub fn snapshot_into(&self, id: SlotId, into: &mut Vec<GdnState>) {
        let states = self.slots[id].iter().flatten();
        if into.len() == states.clone().count() {
            into.iter_mut()
                .zip(states)
                .for_each(|(d, s)| d.clone_from(s));
        } else {
            *into = states.cloned().collect();
        }
    }

    /// Sets slot `id` to a checkpoint taken by [`Self::snapshot`].
    pub fn restore(&mut self, id: SlotId, from: &[GdnState]) {
        let layers = self.slots[id].iter_mut().flatten();
        let mut n = 0;
        for (dst, src) in layers.zip(from) {
            dst.clone_from(src);
            n += 1;
        }
        debug_assert_eq!(n, from.len(), "a checkpoint holds every GDN layer");
    }

    /// One step's view: segment `i` of the pass advances slot `of_segment[i]`.
    pub fn pass(&mut self, of_segment: Vec<Option<SlotId>>) -> SlotPass<'_> {
        SlotPass {
            slots: &mut self.slots,
            of_segment,
        }
    }
}

pub(crate) struct SlotPass<'p> {
    slots: &'p mut [Vec<Option<GdnState>>],
    of_segment: Vec<Option<SlotId>>,
}

impl LayerRecurrent for SlotPass<'_> {
    fn state(&mut self, layer: usize, i: usize) -> &mut GdnState {
        let slot = self.of_segment[i].expect("the engine checks that hybrid sequences hold a slot");
        self.slots[slot][layer]
            .as_mut()
            .expect("a slot holds a state for every GDN layer")
    }
}
