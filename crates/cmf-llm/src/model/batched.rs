//! One forward pass over several sequences at once: every sequence's new rows (one for a decode,
//! a chunk for a prefill) go through each linear layer together — one GEMM over all rows instead
//! of a matvec per sequence, so each weight is read once per step — while RoPE, the KV write and
//! attention run per sequence ([`Segment`]) over its own keys and values ([`LayerKv`]); a
//! GatedDeltaNet layer runs per sequence over that sequence's recurrent state
//! ([`LayerRecurrent`]).

use super::gated_attention::GateScratch;
use super::gdn::GdnScratch;
use super::{Activations, LayerKv, LayerRecurrent, MixerState, Model, Segment};
use crate::profile::{time, Op};
use cmf_kernels::RopeTable;

/// One sequence's part of a batched pass: its new tokens and the position of the first.
pub(crate) struct SeqRows<'t> {
    pub tokens: &'t [u32],
    pub start: usize,
    /// Which of its rows' logits are wanted.
    pub logits: RowLogits,
}

/// The rows of a sequence whose logits a batched pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowLogits {
    None,
    /// The last row (where sampling continues).
    Last,
    /// Every row (a prompt being scored).
    All,
}

impl Model<'_> {
    /// Runs every sequence's rows through every layer, its keys and values stored in and read
    /// from `kv`, its GatedDeltaNet states (hybrid models) advanced in `recurrent`, and returns
    /// the logits (`[m, vocab]`, in `seqs`' order) of the rows wanted ([`RowLogits`]). Token ids
    /// must already be checked against the vocabulary.
    /// (Called inside `cmf_kernels::run_in_pool`.)
    pub(crate) fn forward_batch<'b>(
        &self,
        seqs: &[SeqRows],
        kv: &mut dyn LayerKv,
        recurrent: &mut dyn LayerRecurrent,
        act: &'b mut Activations,
    ) -> &'b [f32] {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        act.ensure(cfg, n.max(1));
        time(Op::Embed, || {
            let rows = seqs.iter().flat_map(|s| s.tokens);
            for (i, &t) in rows.enumerate() {
                let row = &mut act.x[i * h..(i + 1) * h];
                cmf_kernels::reference::decode_row(&self.weights.embed, t as usize, row);
            }
        });
        // cos/sin per sequence: positions differ, and dynamic NTK frequencies depend on each
        // sequence's own length.
        let tables: Vec<RopeTable> = seqs
            .iter()
            .map(|s| {
                let n = s.tokens.len();
                let pos: Vec<f32> = (s.start..s.start + n).map(|p| p as f32).collect();
                let inv_freq = self.rope.inv_freq_for(s.start + n);
                RopeTable::new(&pos, &inv_freq, self.rope.attention_scaling())
            })
            .collect();
        let mut segs = Vec::with_capacity(seqs.len());
        let mut row0 = 0;
        for (s, rope) in seqs.iter().zip(&tables) {
            segs.push(Segment {
                row0,
                n: s.tokens.len(),
                start: s.start,
                rope,
                rope_row0: 0,
            });
            row0 += s.tokens.len();
        }
        let (mut gdn_scratch, mut gate_scratch) = (GdnScratch::default(), GateScratch::default());
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let mix = MixerState {
                gdn: &mut *recurrent,
                gdn_scratch: &mut gdn_scratch,
                gate_scratch: &mut gate_scratch,
            };
            self.layer(l, lw, kv, mix, act, &segs);
        }
        // The wanted rows moved to the front (ascending, so no row is overwritten before it is
        // read), then one lm_head product over them.
        let mut m = 0;
        for (s, seg) in seqs.iter().zip(&segs) {
            let wanted = match s.logits {
                RowLogits::None => continue,
                RowLogits::Last => seg.row0 + seg.n - 1..seg.row0 + seg.n,
                RowLogits::All => seg.row0..seg.row0 + seg.n,
            };
            let k = wanted.len();
            act.x.copy_within(wanted.start * h..wanted.end * h, m * h);
            m += k;
        }
        if m == 0 {
            return &[];
        }
        self.logits_rows(act, 0, m);
        &act.logits[..m * cfg.vocab_size]
    }
}

impl Activations {
    /// The logits of the last pass (`[rows wanted, vocab]` at the front).
    pub(crate) fn logits(&self) -> &[f32] {
        &self.logits
    }
}
