//! Placement: which transformer layers live on the device.
//!
//! `--gpu-layers 0-19,30-39` (or `CMF_GPU_LAYERS`) names the layers explicitly. Without it,
//! a model whose weights and KV cache fit the VRAM budget goes entirely to the device
//! (layers, embedding, final norm, lm_head: the whole-token graph); a model that does not fit
//! puts its first layers on the device, as many as fit, and runs the rest (and the lm_head)
//! on the CPU.

use super::error::GpuError;

/// The environment variable read when no `--gpu-layers` flag was given.
pub const ENV_GPU_LAYERS: &str = "CMF_GPU_LAYERS";

/// A set of layer indices written as comma-separated ranges: `0-19,30-39`, `5`, `all`, `none`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerSet {
    All,
    /// Inclusive ranges, as written.
    Ranges(Vec<(usize, usize)>),
}

impl LayerSet {
    /// Parses a `--gpu-layers` / `CMF_GPU_LAYERS` value; `what` names the source in errors.
    pub fn parse(s: &str, what: &str) -> Result<LayerSet, GpuError> {
        let bad = |why: &'static str| GpuError::BadSetting {
            what: what.to_string(),
            value: s.to_string(),
            expected: why,
        };
        let t = s.trim();
        match t.to_ascii_lowercase().as_str() {
            "all" => return Ok(LayerSet::All),
            "none" | "" => return Ok(LayerSet::Ranges(vec![])),
            _ => {}
        }
        let mut ranges = Vec::new();
        for part in t.split(',') {
            let part = part.trim();
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (part, part),
            };
            let expected = "layer ranges like 0-19,30-39 (or all, none)";
            let a: usize = a.parse().map_err(|_| bad(expected))?;
            let b: usize = b.parse().map_err(|_| bad(expected))?;
            if a > b {
                return Err(bad("ranges written low-high, e.g. 0-19"));
            }
            ranges.push((a, b));
        }
        Ok(LayerSet::Ranges(ranges))
    }

    /// The flag's value when given, else `CMF_GPU_LAYERS`, else None (automatic placement).
    pub fn resolve(flag: Option<&str>) -> Result<Option<LayerSet>, GpuError> {
        match flag {
            Some(f) => LayerSet::parse(f, "--gpu-layers").map(Some),
            None => match std::env::var(ENV_GPU_LAYERS) {
                Ok(v) => LayerSet::parse(&v, ENV_GPU_LAYERS).map(Some),
                Err(_) => Ok(None),
            },
        }
    }

    pub fn contains(&self, layer: usize) -> bool {
        match self {
            LayerSet::All => true,
            LayerSet::Ranges(r) => r.iter().any(|&(a, b)| (a..=b).contains(&layer)),
        }
    }

    /// The first layer index named that the model does not have, if any.
    pub fn out_of_range(&self, num_layers: usize) -> Option<usize> {
        match self {
            LayerSet::All => None,
            LayerSet::Ranges(r) => r.iter().map(|&(_, b)| b).find(|&b| b >= num_layers),
        }
    }
}

/// Where each part of a model runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// `on_device[l]`: layer `l`'s weights and KV cache live on the device.
    pub on_device: Vec<bool>,
    /// Final norm + lm_head (and the embedding) on the device. Only when every layer is.
    pub head_on_device: bool,
}

impl Placement {
    /// Everything on the device.
    pub fn all(num_layers: usize) -> Placement {
        Placement {
            on_device: vec![true; num_layers],
            head_on_device: true,
        }
    }

    /// Nothing on the device.
    pub fn none(num_layers: usize) -> Placement {
        Placement {
            on_device: vec![false; num_layers],
            head_on_device: false,
        }
    }

    /// Whether one device graph can run the whole token (every layer and the head resident).
    pub fn is_whole_model(&self) -> bool {
        self.head_on_device && self.on_device.iter().all(|&d| d)
    }

    pub fn device_layer_count(&self) -> usize {
        self.on_device.iter().filter(|&&d| d).count()
    }

    /// Maximal runs of consecutive layers on the same side, in order: `(device?, first..last+1)`.
    pub fn segments(&self) -> Vec<(bool, std::ops::Range<usize>)> {
        let mut out: Vec<(bool, std::ops::Range<usize>)> = Vec::new();
        for (l, &d) in self.on_device.iter().enumerate() {
            match out.last_mut() {
                Some((side, r)) if *side == d => r.end = l + 1,
                _ => out.push((d, l..l + 1)),
            }
        }
        out
    }

    /// Plans placement for a model.
    ///
    /// - `layer_bytes[l]`: device bytes layer `l` needs (weights in their codec + its KV cache);
    /// - `head_bytes`: embedding + final norm + lm_head (tied embeddings counted once);
    /// - `fixed_bytes`: scratch that exists whatever the placement (activations, workspaces);
    /// - `budget`: the device bytes this model may use;
    /// - `explicit`: `--gpu-layers`, which wins over the budget (the backend still refuses a
    ///   layer that does not fit when it is uploaded).
    pub fn plan(
        layer_bytes: &[u64],
        head_bytes: u64,
        fixed_bytes: u64,
        budget: u64,
        explicit: Option<&LayerSet>,
    ) -> Result<Placement, GpuError> {
        let n = layer_bytes.len();
        if let Some(set) = explicit {
            if let Some(l) = set.out_of_range(n) {
                return Err(GpuError::BadSetting {
                    what: "--gpu-layers".into(),
                    value: format!("layer {l}"),
                    expected: "layer indices below the model's num_layers",
                });
            }
            let on_device: Vec<bool> = (0..n).map(|l| set.contains(l)).collect();
            let head_on_device = on_device.iter().all(|&d| d) && n > 0;
            return Ok(Placement {
                on_device,
                head_on_device,
            });
        }
        let total: u64 = layer_bytes.iter().sum::<u64>() + head_bytes + fixed_bytes;
        if total <= budget {
            return Ok(Placement::all(n));
        }
        // First layers while they fit; the head stays with the last layer, on the CPU.
        let mut used = fixed_bytes;
        let mut on_device = vec![false; n];
        for (l, &b) in layer_bytes.iter().enumerate() {
            if used + b > budget {
                break;
            }
            used += b;
            on_device[l] = true;
        }
        Ok(Placement {
            on_device,
            head_on_device: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges() {
        assert_eq!(
            LayerSet::parse("0-19, 30-39", "--gpu-layers").unwrap(),
            LayerSet::Ranges(vec![(0, 19), (30, 39)])
        );
        assert_eq!(
            LayerSet::parse("5", "x").unwrap(),
            LayerSet::Ranges(vec![(5, 5)])
        );
        assert_eq!(LayerSet::parse("all", "x").unwrap(), LayerSet::All);
        assert_eq!(
            LayerSet::parse("none", "x").unwrap(),
            LayerSet::Ranges(vec![])
        );
        for bad in ["0-", "a-3", "3-1", "1,,2", "-1"] {
            let e = LayerSet::parse(bad, "--gpu-layers").unwrap_err();
            assert!(e.to_string().contains("--gpu-layers"), "{bad}: {e}");
        }
    }

    #[test]
    fn explicit_layers_win_over_budget() {
        let set = LayerSet::parse("0-1,3", "x").unwrap();
        let p = Placement::plan(&[10; 4], 5, 0, 1, Some(&set)).unwrap();
        assert_eq!(p.on_device, vec![true, true, false, true]);
        assert!(!p.head_on_device);
        assert_eq!(
            p.segments(),
            vec![(true, 0..2), (false, 2..3), (true, 3..4)]
        );
        let all = Placement::plan(&[10; 4], 5, 0, 1, Some(&LayerSet::All)).unwrap();
        assert!(all.is_whole_model());
        let e = Placement::plan(
            &[10; 4],
            5,
            0,
            1,
            Some(&LayerSet::parse("2-4", "x").unwrap()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("layer 4"), "{e}");
    }

    #[test]
    fn fitting_model_goes_whole() {
        let p = Placement::plan(&[10; 4], 5, 3, 48, None).unwrap();
        assert!(p.is_whole_model());
    }

    #[test]
    fn oversized_model_puts_first_layers_on_device() {
        // 4 layers of 10, head 5, scratch 3: needs 48; a budget of 30 fits 2 layers + scratch.
        let p = Placement::plan(&[10; 4], 5, 3, 30, None).unwrap();
        assert_eq!(p.on_device, vec![true, true, false, false]);
        assert!(!p.head_on_device);
        assert_eq!(p.device_layer_count(), 2);
        // Nothing fits: everything on the CPU.
        let none = Placement::plan(&[10; 4], 5, 3, 5, None).unwrap();
        assert_eq!(none.device_layer_count(), 0);
    }
}
