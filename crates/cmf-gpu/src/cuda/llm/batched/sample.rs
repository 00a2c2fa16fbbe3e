//! A batched step's sampled rows on the device (sample.cu's `*_rows` kernels): every row's
//! penalties, temperature, top-k / top-p / min-p and draw in one chain of launches over all the
//! rows, and only their ids come back. Each row takes the chain the single-sequence sampler
//! takes for its spec (`sampler::takes_vocab_passes`) through the same device functions, so a
//! row draws what the single-sequence sampler draws from the same logits, and the host sampler
//! too (within `llm::sample`'s rounding notes).

use super::super::kernels::RowSampleKernels;
use super::super::sampler::{
    takes_vocab_passes, FIN_THREADS, RADIX_PASSES, SCRATCH_BYTES, VOCAB_THREADS,
};
use super::super::workspace::{SAMPLE_BLOCKS, TOPK_MAX};
use super::super::CudaLlm;
use super::Grow;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, Dev, DevError};
use crate::llm::batch::RowSampling;
use crate::llm::sample::uniform24;

/// Bytes of one packed row (sample.cu's `struct RowSpec`).
pub const ROW_SPEC_BYTES: usize = 48;
/// Threads of a merge-candidate block (sample.cu's `SAMPLE_THREADS`).
const SAMPLE_THREADS: u32 = 256;
/// Rows one chain takes (the grids' y dimension).
const MAX_ROWS: usize = 65_535;

/// The device buffers of the sampled rows, grown on demand.
#[derive(Default)]
pub(in super::super) struct RowSampleBufs {
    specs: Grow,
    windows: Grow,
    cand_v: Grow,
    cand_i: Grow,
    weights: Grow,
    scratch: Grow,
    ids: Grow,
}

/// The rows packed for the device, and which launches any of them needs.
#[derive(Debug, Default)]
struct Packed {
    specs: Vec<u8>,
    /// Every penalised row's window, one after the other.
    windows: Vec<i32>,
    penalties: bool,
    merge: bool,
    vocab: bool,
    radix: bool,
}

/// Packs each row as sample.cu's `RowSpec`: the candidates to merge (1 for greedy specs, top-k's
/// k, 0 for the vocabulary passes), the spec, its window's place, and the draw's uniform integer.
fn pack(rows: &[RowSampling], vocab: usize) -> Packed {
    let mut p = Packed::default();
    for r in rows {
        let s = &r.spec;
        let (k, temperature) = if s.is_greedy() {
            (1, 0.0)
        } else if takes_vocab_passes(s, vocab) {
            (0, s.temperature)
        } else {
            (s.top_k as i32, s.temperature)
        };
        let (win_at, win_len) = if s.has_penalties() && !r.window.is_empty() {
            let at = p.windows.len();
            p.windows.extend(r.window.iter().map(|&t| t as i32));
            (at as i32, r.window.len() as i32)
        } else {
            (0, 0)
        };
        p.penalties |= win_len > 0;
        p.merge |= k > 0;
        p.vocab |= k == 0;
        p.radix |= k == 0 && s.top_p < 1.0;
        let b = &mut p.specs;
        b.extend(k.to_le_bytes());
        b.extend((s.top_k.min(i32::MAX as usize) as i32).to_le_bytes());
        for f in [
            temperature,
            s.top_p,
            s.min_p,
            s.repeat_penalty,
            s.presence_penalty,
            s.frequency_penalty,
        ] {
            b.extend(f.to_le_bytes());
        }
        b.extend(win_at.to_le_bytes());
        b.extend(win_len.to_le_bytes());
        b.extend(uniform24(s.seed, r.pos).to_le_bytes());
    }
    debug_assert_eq!(p.specs.len(), rows.len() * ROW_SPEC_BYTES);
    p
}

/// Draws each row's token from `logits` (`[rows.len(), vocab]` on the device; the penalties
/// edit them in place) into `ids`. The rows' specs must be within the device's limits
/// (`RowSampling::device_limit`, checked by `batch::validate`).
pub(super) fn sample_rows(
    dev: &Dev,
    k: &RowSampleKernels,
    bufs: &mut RowSampleBufs,
    logits: u64,
    vocab: usize,
    rows: &[RowSampling],
    ids: &mut [u32],
) -> DResult<()> {
    let m = rows.len();
    if m == 0 {
        return Ok(());
    }
    if m > MAX_ROWS || ids.len() != m {
        return Err(DevError(format!(
            "batched sampling: {m} rows for {} ids (at most {MAX_ROWS})",
            ids.len()
        )));
    }
    let p = pack(rows, vocab);
    let specs = bufs.specs.at_least(dev, p.specs.len())?;
    dev.upload(specs, &p.specs)?;
    let ids_at = bufs.ids.at_least(dev, 4 * m)?;
    let (v, my) = (vocab as i32, m as u32);
    if p.penalties {
        let win = bufs.windows.at_least(dev, 4 * p.windows.len())?;
        dev.upload(win, bytes_of(&p.windows))?;
        dev.launch(
            &k.penalize,
            (1, my, 1),
            (FIN_THREADS as u32, 1, 1),
            0,
            &[
                Arg::Ptr(logits),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(win),
            ],
        )?;
    }
    if p.merge {
        let cand = 4 * m * SAMPLE_BLOCKS * TOPK_MAX;
        let (cv, ci) = (
            bufs.cand_v.at_least(dev, cand)?,
            bufs.cand_i.at_least(dev, cand)?,
        );
        dev.launch(
            &k.topk_partial,
            (SAMPLE_BLOCKS as u32, my, 1),
            (SAMPLE_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(logits),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(cv),
                Arg::Ptr(ci),
            ],
        )?;
        dev.launch(
            &k.sample_final,
            (1, my, 1),
            (FIN_THREADS as u32, 1, 1),
            0,
            &[
                Arg::Ptr(cv),
                Arg::Ptr(ci),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(ids_at),
            ],
        )?;
    }
    if p.vocab {
        let wbuf = bufs.weights.at_least(dev, 4 * m * vocab)?;
        let sc = bufs.scratch.at_least(dev, m * SCRATCH_BYTES)?;
        let grid = (SAMPLE_BLOCKS as u32, my, 1);
        let block = (VOCAB_THREADS as u32, 1, 1);
        dev.launch(
            &k.sample_max,
            grid,
            block,
            0,
            &[Arg::Ptr(logits), Arg::I32(v), Arg::Ptr(specs), Arg::Ptr(sc)],
        )?;
        dev.launch(
            &k.sample_weights,
            grid,
            block,
            0,
            &[
                Arg::Ptr(logits),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(wbuf),
                Arg::Ptr(sc),
            ],
        )?;
        if p.radix {
            for pass in 1..RADIX_PASSES as i32 {
                dev.launch(
                    &k.sample_radix,
                    grid,
                    block,
                    0,
                    &[
                        Arg::Ptr(logits),
                        Arg::Ptr(wbuf),
                        Arg::I32(v),
                        Arg::Ptr(specs),
                        Arg::I32(pass),
                        Arg::Ptr(sc),
                    ],
                )?;
            }
        }
        dev.launch(
            &k.sample_kept,
            grid,
            block,
            0,
            &[
                Arg::Ptr(logits),
                Arg::Ptr(wbuf),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(sc),
            ],
        )?;
        dev.launch(
            &k.sample_draw,
            (1, my, 1),
            (FIN_THREADS as u32, 1, 1),
            0,
            &[
                Arg::Ptr(logits),
                Arg::Ptr(wbuf),
                Arg::I32(v),
                Arg::Ptr(specs),
                Arg::Ptr(sc),
                Arg::Ptr(ids_at),
            ],
        )?;
    }
    let mut raw = vec![0i32; m];
    // SAFETY: i32 has no invalid bit patterns; the view covers exactly `raw`.
    let bytes = unsafe { std::slice::from_raw_parts_mut(raw.as_mut_ptr() as *mut u8, 4 * m) };
    dev.download(bytes, ids_at)?;
    for (i, (d, &r)) in ids.iter_mut().zip(&raw).enumerate() {
        if r < 0 || r as usize >= vocab {
            return Err(DevError(format!(
                "the device sampler drew {r} for row {i}, outside the vocabulary of {vocab}"
            )));
        }
        *d = r as u32;
    }
    Ok(())
}

impl CudaLlm {
    /// Test hook: the batched rows' sampler alone over host logits `[rows.len(), V]` (no step
    /// before it), each row with its own spec, position and window; returns the ids.
    pub fn sample_rows(&mut self, logits: &[f32], rows: &[RowSampling]) -> DResult<Vec<u32>> {
        let v = self.spec.vocab;
        if logits.len() != rows.len() * v {
            return Err(DevError(format!(
                "sample_rows: {} logits for {} rows of {v}",
                logits.len(),
                rows.len()
            )));
        }
        if let Some((i, why)) = rows
            .iter()
            .enumerate()
            .find_map(|(i, r)| r.device_limit().map(|w| (i, w)))
        {
            return Err(DevError(format!("sample_rows: row {i}: {why}")));
        }
        self.settle()?;
        let buf = self.dev.upload_new(bytes_of(logits))?;
        let mut bufs = RowSampleBufs::default();
        let mut ids = vec![0u32; rows.len()];
        sample_rows(
            &self.dev,
            &self.ck.rows,
            &mut bufs,
            buf.ptr(),
            v,
            rows,
            &mut ids,
        )?;
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::llm::kernels::SAMPLE;
    use crate::llm::sample::SampleSpec;

    /// sample.cu's `struct RowSpec`: its fields in order, as `pack` writes them.
    #[test]
    fn row_spec_matches_sample_cu() {
        let body = SAMPLE
            .split("struct RowSpec {")
            .nth(1)
            .and_then(|s| s.split("};").next())
            .expect("struct RowSpec in sample.cu");
        let fields: Vec<(String, String)> = body
            .lines()
            .map(|l| l.split("//").next().unwrap().trim())
            .filter(|l| !l.is_empty())
            .map(|l| {
                let mut w = l.trim_end_matches(';').split_whitespace();
                (w.next().unwrap().into(), w.next().unwrap().into())
            })
            .collect();
        let want = [
            ("int", "k"),
            ("int", "top_k"),
            ("float", "temperature"),
            ("float", "top_p"),
            ("float", "min_p"),
            ("float", "repeat"),
            ("float", "presence"),
            ("float", "frequency"),
            ("int", "win_at"),
            ("int", "win_len"),
            ("u64", "u24"),
        ];
        let got: Vec<(&str, &str)> = fields
            .iter()
            .map(|(t, n)| (t.as_str(), n.as_str()))
            .collect();
        assert_eq!(got, want);
        let bytes: usize = got
            .iter()
            .map(|(t, _)| if *t == "u64" { 8 } else { 4 })
            .sum();
        assert_eq!(bytes, ROW_SPEC_BYTES);
    }

    /// Each row takes the single-sequence chain of its spec; windows only for penalised rows.
    #[test]
    fn pack_picks_each_rows_chain() {
        let spec = |temperature: f32, top_k: usize, top_p: f32| SampleSpec {
            temperature,
            top_k,
            top_p,
            ..SampleSpec::default()
        };
        let pen = SampleSpec {
            repeat_penalty: 1.3,
            ..spec(0.8, 0, 1.0)
        };
        let win = [5u32, 9, 5];
        let rows = [
            RowSampling {
                spec: spec(0.0, 0, 1.0),
                pos: 3,
                window: &win,
            },
            RowSampling {
                spec: spec(0.7, 40, 1.0),
                pos: 4,
                window: &win,
            },
            RowSampling {
                spec: pen,
                pos: 5,
                window: &win,
            },
            RowSampling {
                spec: spec(0.7, 1000, 0.9),
                pos: 6,
                window: &win,
            },
        ];
        let p = pack(&rows, 1000);
        let word = |r: usize, w: usize| -> [u8; 4] {
            p.specs[r * ROW_SPEC_BYTES + 4 * w..][..4]
                .try_into()
                .unwrap()
        };
        let ks: Vec<i32> = (0..4).map(|r| i32::from_le_bytes(word(r, 0))).collect();
        assert_eq!(ks, [1, 40, 0, 0]);
        assert_eq!(f32::from_le_bytes(word(0, 2)), 0.0);
        assert_eq!(p.windows, [5, 9, 5]);
        assert_eq!(i32::from_le_bytes(word(2, 9)), 3);
        assert_eq!(i32::from_le_bytes(word(1, 9)), 0);
        let u24 = u64::from_le_bytes(p.specs[3 * ROW_SPEC_BYTES + 40..][..8].try_into().unwrap());
        assert_eq!(u24, uniform24(0, 6));
        assert!(p.penalties && p.merge && p.vocab && p.radix);
        assert!(!pack(&rows[..2], 1000).vocab && !pack(&rows[..2], 1000).penalties);
    }
}
