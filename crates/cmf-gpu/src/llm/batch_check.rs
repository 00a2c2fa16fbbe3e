//! A staggered batched run checked against the reference forward, shared by the fake backend's
//! test and the device test: sequences join at different steps, prompts arrive in chunks beside
//! decode rows, one sequence starts on another's blocks (a shared prefix), and every table is a
//! shuffled, non-consecutive set of pool blocks.

use super::batch::{BatchOut, BatchSeq};
use super::reference::{self, RefCache};
use super::synth::Rng;
use super::LlmModel;
use crate::facade::{LlmDevice, Refusal};

/// What a run measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CheckReport {
    /// Largest relative L2 error of a returned logits row (0 for greedy runs).
    pub max_rel_err: f64,
    /// Outputs whose arg-max differed from the reference's.
    pub argmax_mismatches: usize,
    /// Outputs compared.
    pub outputs: usize,
}

struct Seq {
    tokens: Vec<u32>,
    done: usize,
    table: Vec<u32>,
    cache: RefCache,
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Runs the schedule on `dev` (whose pool it allocates) and compares each output with
/// `reference::forward_token` run per sequence; greedy: device arg-max ids, else logits.
pub fn staggered_run(
    dev: &mut dyn LlmDevice,
    model: &LlmModel,
    greedy: bool,
    seed: u64,
) -> Result<CheckReport, Refusal> {
    const BS: usize = 16;
    let s = &model.spec;
    let (v, layers) = (s.vocab, s.num_layers);
    // 64 blocks at f32 (more at f16).
    let bytes = (2 * layers * BS * s.kv_dim() * 4 * 64) as u64;
    let shape = dev.kv_pool(bytes, BS)?;
    let mut rng = Rng::new(seed);
    let mut free: Vec<u32> = (0..shape.blocks as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % v as u64) as u32).collect() };
    let new_seq = |tokens: Vec<u32>| Seq {
        tokens,
        done: 0,
        table: Vec::new(),
        cache: RefCache::new(layers),
    };
    let mut seqs = vec![new_seq(prompt(37)), new_seq(prompt(20)), new_seq(prompt(5))];
    let own = prompt(8);
    // (sequence, tokens) per step; sequence 3 joins at step 2 on sequence 0's first two blocks.
    let schedule: Vec<Vec<(usize, usize)>> = vec![
        vec![(0, 16), (1, 20)],
        vec![(0, 21), (1, 1), (2, 5)],
        vec![(0, 1), (1, 1), (2, 1), (3, 8)],
        vec![(3, 1), (0, 1), (1, 1), (2, 1)],
        vec![(2, 1), (3, 1), (0, 1), (1, 1)],
    ];
    let mut report = CheckReport::default();
    for (step, plan) in schedule.iter().enumerate() {
        if step == 2 {
            let a = &seqs[0];
            let mut tokens = a.tokens[..2 * BS].to_vec();
            tokens.extend_from_slice(&own);
            let mut cache = a.cache.clone();
            cache.truncate(2 * BS, s.kv_dim());
            seqs.push(Seq {
                tokens,
                done: 2 * BS,
                table: a.table[..2].to_vec(),
                cache,
            });
        }
        for &(i, n) in plan {
            let q = &mut seqs[i];
            while q.table.len() * BS < q.done + n {
                q.table.push(free.pop().expect("pool holds the schedule"));
            }
        }
        let items: Vec<BatchSeq> = plan
            .iter()
            .map(|&(i, n)| {
                let q = &seqs[i];
                BatchSeq {
                    tokens: &q.tokens[q.done..q.done + n],
                    start: q.done,
                    blocks: &q.table,
                    want: q.done + n == q.tokens.len(),
                }
            })
            .collect();
        let m = items.iter().filter(|b| b.want).count();
        let mut logits = vec![f32::NAN; if greedy { 0 } else { m * v }];
        let mut ids = vec![u32::MAX; if greedy { m } else { 0 }];
        let out = if greedy {
            BatchOut::Greedy(&mut ids)
        } else {
            BatchOut::Logits(&mut logits)
        };
        dev.batch_step(&items, out)?;
        drop(items);
        let mut j = 0;
        for &(i, n) in plan {
            let q = &mut seqs[i];
            let mut last = Vec::new();
            for p in q.done..q.done + n {
                last = reference::forward_token(model, q.tokens[p], p, &mut q.cache);
            }
            q.done += n;
            if q.done < q.tokens.len() {
                continue;
            }
            let want = reference::argmax(&last);
            let got = if greedy {
                ids[j]
            } else {
                let row = &logits[j * v..(j + 1) * v];
                report.max_rel_err = report.max_rel_err.max(rel_err(row, &last));
                reference::argmax(row)
            };
            report.argmax_mismatches += (got != want) as usize;
            report.outputs += 1;
            j += 1;
            // Teacher forcing: every sequence continues with the reference's choice.
            q.tokens.push(want);
        }
    }
    Ok(report)
}
