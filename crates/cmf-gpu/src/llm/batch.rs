//! The batched step's contract: many sequences' rows through the model in one pass, each
//! sequence's keys and values in a device block pool addressed by its block table. The caller
//! (cmf-llm's batched engine) owns the bookkeeping (which blocks a sequence holds, prefix reuse);
//! the device owns the pool's memory.

use crate::facade::refusal::{Refusal, RefusalReason};
use crate::llm::sample::{self, SampleSpec};

/// One sequence's share of a batched step.
#[derive(Debug, Clone, Copy)]
pub struct BatchSeq<'a> {
    /// Its new tokens, at positions `start..start + tokens.len()`.
    pub tokens: &'a [u32],
    pub start: usize,
    /// Its block table: block `blocks[i]` of the pool holds positions `i·B..(i + 1)·B` (B the
    /// pool's block size); covers at least `start + tokens.len()` positions.
    pub blocks: &'a [u32],
    /// Whether its last row's output comes back.
    pub want: bool,
}

/// What a batched step returns for the sequences that `want` it, in their order.
#[derive(Debug)]
pub enum BatchOut<'a> {
    /// Each one's last-row logits, `[m, V]`.
    Logits(&'a mut [f32]),
    /// Each one's arg-max id (ties to the lowest), `[m]`.
    Greedy(&'a mut [u32]),
    /// Each one's token drawn by its own sampler (`rows[i]` for the `i`-th), `[m]`: the token
    /// the host sampler draws from the same logits ([`RowSampling::sample_host`]).
    Sampled {
        rows: &'a [RowSampling<'a>],
        ids: &'a mut [u32],
    },
}

impl BatchOut<'_> {
    fn len(&self) -> usize {
        match self {
            BatchOut::Logits(l) => l.len(),
            BatchOut::Greedy(t) => t.len(),
            BatchOut::Sampled { ids, .. } => ids.len(),
        }
    }
}

/// One sequence's sampler in a [`BatchOut::Sampled`] step: what the host sampler reads besides
/// the logits.
#[derive(Debug, Clone, Copy)]
pub struct RowSampling<'a> {
    pub spec: SampleSpec,
    /// Position of the token these logits follow (the draw is `uniform24(spec.seed, pos)`).
    pub pos: u64,
    /// The penalty window: the sequence's last `spec.penalty_last_n` ids, the token at `pos`
    /// last.
    pub window: &'a [u32],
}

impl RowSampling<'_> {
    /// The host sampler's token for `logits` (which get the penalties).
    pub fn sample_host(&self, logits: &mut [f32]) -> u32 {
        sample::sample(logits, self.window, &self.spec, self.pos)
    }

    /// Why the device cannot draw this row (its logits then come back), or None.
    pub fn device_limit(&self) -> Option<String> {
        if let Err(why) = self.spec.validate() {
            return Some(why);
        }
        if self.window.len() > self.spec.penalty_last_n {
            return Some(format!(
                "penalty window of {} ids, penalty_last_n {}",
                self.window.len(),
                self.spec.penalty_last_n
            ));
        }
        self.spec.device_limit()
    }
}

/// The device block pool's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Positions per block.
    pub block_size: usize,
    pub blocks: usize,
}

/// Rows of a step over `seqs`.
pub fn rows(seqs: &[BatchSeq]) -> usize {
    seqs.iter().map(|s| s.tokens.len()).sum()
}

/// Checks a step against the pool and the model before anything runs; the refusal names the
/// sequence and field at fault. `max_rows` caps the rows of one step.
pub fn validate(
    seqs: &[BatchSeq],
    out: &BatchOut,
    pool: Option<PoolShape>,
    vocab: usize,
    max_rows: usize,
) -> Result<(), Refusal> {
    const OP: &str = "llm.batch_step";
    let bad = |m: String| Err(Refusal::new(OP, RefusalReason::UnsupportedShape(m)));
    let Some(pool) = pool else {
        return Err(Refusal::new(
            OP,
            RefusalReason::NotResident("no KV block pool (kv_pool first)".into()),
        ));
    };
    if seqs.is_empty() {
        return bad("a step needs at least one sequence".into());
    }
    let n = rows(seqs);
    if n > max_rows {
        return bad(format!("{n} rows, at most {max_rows} per step"));
    }
    for (i, s) in seqs.iter().enumerate() {
        if s.tokens.is_empty() {
            return bad(format!("sequence {i}: no tokens"));
        }
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("sequence {i}: token {t} ≥ vocab {vocab}"));
        }
        let end = s.start + s.tokens.len();
        if s.blocks.len() * pool.block_size < end {
            return bad(format!(
                "sequence {i}: {} blocks of {} do not hold {end} positions",
                s.blocks.len(),
                pool.block_size
            ));
        }
        if let Some(b) = s.blocks.iter().find(|&&b| b as usize >= pool.blocks) {
            return bad(format!(
                "sequence {i}: block {b} outside the pool of {}",
                pool.blocks
            ));
        }
    }
    let m = seqs.iter().filter(|s| s.want).count();
    let need = match out {
        BatchOut::Logits(_) => m * vocab,
        BatchOut::Greedy(_) | BatchOut::Sampled { .. } => m,
    };
    if out.len() != need {
        return bad(format!("output of {} values, {need} needed", out.len()));
    }
    if let BatchOut::Sampled { rows, .. } = out {
        if rows.len() != m {
            return bad(format!("{} samplers for {m} outputs", rows.len()));
        }
        for (i, r) in rows.iter().enumerate() {
            if let Some(why) = r.device_limit() {
                return bad(format!("output {i}'s sampler: {why}"));
            }
        }
    }
    Ok(())
}

/// Pool slot (block · B + offset) of each row of `seqs`, and each row's position.
pub fn row_slots(seqs: &[BatchSeq], block_size: usize) -> (Vec<i32>, Vec<i32>) {
    let mut slots = Vec::with_capacity(rows(seqs));
    let mut pos = Vec::with_capacity(slots.capacity());
    for s in seqs {
        for p in s.start..s.start + s.tokens.len() {
            slots.push((s.blocks[p / block_size] as usize * block_size + p % block_size) as i32);
            pos.push(p as i32);
        }
    }
    (slots, pos)
}

/// The paged attention the device runs, in plain f32 (its parity tests' oracle): for each row
/// `t` (position `row_pos[t]` of sequence `row_seq[t]`) and query head, softmax-weighted values
/// over that sequence's positions `first..=row_pos[t]` (`first` from the sliding `window`; 0:
/// none), read through its block table. `q`, `out`: `[T, NH, D]`; pools `[NKV, S_pool, D]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_reference(
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    geometry: (usize, usize, usize),
    scale: f32,
    window: usize,
    row_pos: &[usize],
    row_seq: &[usize],
    tables: &[&[u32]],
    block_size: usize,
    out: &mut [f32],
) {
    let (nh, nkv, d) = geometry;
    let s_pool = k_pool.len() / (nkv * d);
    let group = nh / nkv;
    for (t, (&pos, &seq)) in row_pos.iter().zip(row_seq).enumerate() {
        let first = if window > 0 {
            (pos + 1).saturating_sub(window)
        } else {
            0
        };
        let slot = |p: usize| tables[seq][p / block_size] as usize * block_size + p % block_size;
        for h in 0..nh {
            let kh = h / group;
            let qh = &q[(t * nh + h) * d..][..d];
            let row = |pool: &'_ [f32], p: usize| -> Vec<f32> {
                pool[(kh * s_pool + slot(p)) * d..][..d].to_vec()
            };
            let scores: Vec<f32> = (first..=pos)
                .map(|p| {
                    qh.iter()
                        .zip(row(k_pool, p))
                        .map(|(a, b)| a * b)
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|v| (v - m).exp()).collect();
            let sum: f32 = e.iter().sum();
            let o = &mut out[(t * nh + h) * d..][..d];
            o.fill(0.0);
            for (w, p) in e.iter().zip(first..=pos) {
                for (a, b) in o.iter_mut().zip(row(v_pool, p)) {
                    *a += w / sum * b;
                }
            }
        }
    }
}

/// The batched step's q8_row GEMM in plain arithmetic (its parity tests' oracle): each input
/// row rounded to bf16 and quantised in blocks of 32 (s8 at scale amax / 127, ties to even),
/// exact integer sums per block, f32 sums over blocks times the block's input scale, times the
/// weight row's scale. `w` s8 `[n, k]`, `x` `[t, k]`; returns `[t, n]`.
pub fn q8_gemm_reference(w: &[i8], scales: &[half::f16], k: usize, x: &[f32]) -> Vec<f32> {
    let (n, t) = (scales.len(), x.len() / k);
    let mut out = vec![0f32; t * n];
    for r in 0..t {
        let mut xq = vec![0i32; k];
        let mut xd = vec![0f32; k / 32];
        for b in 0..k / 32 {
            let vals: Vec<f32> = x[r * k + 32 * b..r * k + 32 * b + 32]
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            let (d, q) = super::reference::s8_block(&vals);
            xq[32 * b..32 * b + 32].copy_from_slice(&q);
            xd[b] = d;
        }
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let mut acc = 0f32;
            for (b, d) in xd.iter().enumerate() {
                let s: i32 = (32 * b..32 * b + 32).map(|i| xq[i] * wr[i] as i32).sum();
                acc += s as f32 * d;
            }
            out[r * n + c] = acc * scales[c].to_f32();
        }
    }
    out
}

/// The batched step's W8A16 GEMM in plain arithmetic: each input rounded to bf16, times the s8
/// weights, summed in f64, times the weight row's scale. `w` s8 `[n, k]`, `x` `[t, k]`; returns
/// `[t, n]`.
pub fn w8_bf16_gemm_reference(w: &[i8], scales: &[half::f16], k: usize, x: &[f32]) -> Vec<f32> {
    let (n, t) = (scales.len(), x.len() / k);
    let xb: Vec<f64> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32() as f64)
        .collect();
    let mut out = vec![0f32; t * n];
    for r in 0..t {
        for c in 0..n {
            let s: f64 = (0..k).map(|i| xb[r * k + i] * w[c * k + i] as f64).sum();
            out[r * n + c] = (s * scales[c].to_f32() as f64) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::synth::Rng;

    /// The paged reference reads each position through its sequence's table: the same keys and
    /// values laid out in shuffled blocks give the same output as in blocks in order.
    #[test]
    fn paged_reference_follows_the_block_tables() {
        let (nh, nkv, d, bs) = (4, 2, 8, 4);
        let lens = [9usize, 3, 16];
        let blocks_of = |n: usize| n.div_ceil(bs);
        let total: usize = lens.iter().map(|&n| blocks_of(n)).sum();
        let mut rng = Rng::new(3);
        // Keys and values per sequence and position, [NKV, D] each.
        let kv: Vec<Vec<(Vec<f32>, Vec<f32>)>> = lens
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| (rng.vec(nkv * d, 1.0), rng.vec(nkv * d, 1.0)))
                    .collect()
            })
            .collect();
        let mut perm: Vec<u32> = (0..total as u32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        // Each sequence's last 2 positions attend (ragged: causal within the "chunk").
        let mut row_pos = Vec::new();
        let mut row_seq = Vec::new();
        for (s, &n) in lens.iter().enumerate() {
            for p in n.saturating_sub(2)..n {
                row_pos.push(p);
                row_seq.push(s);
            }
        }
        let q = rng.vec(row_pos.len() * nh * d, 1.0);
        let run = |ids: &dyn Fn(usize) -> u32, window: usize| -> Vec<f32> {
            let s_pool = total * bs;
            let (mut kp, mut vp) = (vec![0f32; nkv * s_pool * d], vec![0f32; nkv * s_pool * d]);
            let mut tables: Vec<Vec<u32>> = Vec::new();
            let mut next = 0;
            for (s, &n) in lens.iter().enumerate() {
                let t: Vec<u32> = (next..next + blocks_of(n)).map(ids).collect();
                next += blocks_of(n);
                for p in 0..n {
                    let slot = t[p / bs] as usize * bs + p % bs;
                    for h in 0..nkv {
                        kp[(h * s_pool + slot) * d..][..d]
                            .copy_from_slice(&kv[s][p].0[h * d..][..d]);
                        vp[(h * s_pool + slot) * d..][..d]
                            .copy_from_slice(&kv[s][p].1[h * d..][..d]);
                    }
                }
                tables.push(t);
            }
            let tabs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
            let mut out = vec![0f32; q.len()];
            paged_attention_reference(
                &q,
                &kp,
                &vp,
                (nh, nkv, d),
                0.35,
                window,
                &row_pos,
                &row_seq,
                &tabs,
                bs,
                &mut out,
            );
            out
        };
        for window in [0, 5] {
            let ordered = run(&|i| i as u32, window);
            let shuffled = run(&|i| perm[i], window);
            assert_eq!(ordered, shuffled);
            assert!(ordered.iter().all(|x| x.is_finite()));
        }
        // A window changes what the long sequences see.
        assert_ne!(run(&|i| i as u32, 0), run(&|i| i as u32, 5));
    }

    #[test]
    fn row_slots_follow_the_tables() {
        let seqs = [
            BatchSeq {
                tokens: &[1, 2, 3],
                start: 15,
                blocks: &[7, 2],
                want: true,
            },
            BatchSeq {
                tokens: &[4],
                start: 0,
                blocks: &[5],
                want: false,
            },
        ];
        let (slots, pos) = row_slots(&seqs, 16);
        assert_eq!(pos, [15, 16, 17, 0]);
        assert_eq!(slots, [7 * 16 + 15, 2 * 16, 2 * 16 + 1, 5 * 16]);
    }
}
