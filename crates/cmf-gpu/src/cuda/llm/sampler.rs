//! The device sampler's launches (`kernels/sample.cu`): which chain a spec takes, and for
//! sampled specs without top-k the vocabulary passes spread over `SAMPLE_BLOCKS` blocks — their
//! slicing and the scratch layout they share (sample.cu's `SC_*` words, mirrored here and
//! checked against the source by a test). The tests also run a CPU model of those passes, phase
//! by phase with the same per-slice partials, against the host sampler (`llm::sample`).

use super::workspace::{HIST_SLOTS, SAMPLE_BLOCKS};
use super::CudaLlm;
use crate::cuda::runtime::device::{bytes_of, Arg, DResult, DevError};
use crate::llm::sample::SampleSpec;
use crate::llm::Sampler;

/// Threads of a vocabulary pass's block (sample.cu's `VOCAB_THREADS`).
pub const VOCAB_THREADS: usize = 256;
/// Threads of the single-block kernels (`FIN_THREADS`).
pub const FIN_THREADS: usize = 1024;
/// Radix passes over the 32-bit order keys (digits of 11, 11, 10 bits) and the most bins one
/// pass histograms (`RADIX_PASSES`, `RADIX_BINS`).
pub const RADIX_PASSES: usize = 3;
pub const RADIX_BINS: usize = 2048;

/// Word offsets (u64) into the vocabulary passes' scratch, as sample.cu's `SC_*`.
pub mod sc {
    use super::{RADIX_BINS, RADIX_PASSES, SAMPLE_BLOCKS};
    // Words 0.. hold one histogram of weights per radix pass.
    /// The weight of every token.
    pub const TOTAL: usize = RADIX_PASSES * RADIX_BINS;
    /// Float bits of the best logit.
    pub const MAX: usize = TOTAL + 1;
    /// Per pass: the cut's key prefix | mask << 32, and the weight before it.
    pub const PLAN: usize = MAX + 1;
    /// Per slice: its arg-max (value bits << 32 | id).
    pub const ARG: usize = PLAN + 2 * RADIX_PASSES;
    /// Per slice: the weight that survives for sure, and the ties of the cut key.
    pub const KEPT: usize = ARG + SAMPLE_BLOCKS;
    pub const TIES: usize = KEPT + SAMPLE_BLOCKS;
    pub const WORDS: usize = TIES + SAMPLE_BLOCKS;
}

// sample_draw gives a thread to each slice's partials; a radix plan gives each thread whole bins.
const _: () = assert!(
    SAMPLE_BLOCKS <= FIN_THREADS
        && RADIX_BINS % VOCAB_THREADS == 0
        && (RADIX_BINS / 2) % VOCAB_THREADS == 0
);

/// Bytes of the vocabulary passes' scratch.
pub const SCRATCH_BYTES: usize = 8 * sc::WORDS;

/// Whether a spec draws through the vocabulary passes: every sampled spec but top-k's (whose
/// survivors are among the merged candidates). Greedy and top-k specs take the merge.
pub fn takes_vocab_passes(spec: &SampleSpec, vocab: usize) -> bool {
    !spec.is_greedy() && (spec.top_k == 0 || spec.top_k >= vocab)
}

impl CudaLlm {
    /// The vocabulary passes of a sampled spec without top-k (sample.cu): slice arg-maxes,
    /// weights (and the radix's first histogram when top-p cuts), two more radix passes for
    /// top-p, the kept weight per slice, and the draw.
    pub(super) fn enqueue_vocab_sample(&self, spec: &SampleSpec) -> DResult<()> {
        let ws = &self.ws;
        let v = self.spec.vocab as i32;
        let sc = ws.sample_scratch.ptr();
        let radix = (spec.top_p < 1.0) as i32;
        let grid = (SAMPLE_BLOCKS as u32, 1, 1);
        let block = (VOCAB_THREADS as u32, 1, 1);
        let (logits, wbuf) = (ws.logits.ptr(), ws.weights.ptr());
        self.go(
            &self.ck.sample_max,
            grid,
            block,
            0,
            &[Arg::Ptr(logits), Arg::I32(v), Arg::Ptr(sc)],
        )?;
        self.go(
            &self.ck.sample_weights,
            grid,
            block,
            0,
            &[
                Arg::Ptr(logits),
                Arg::I32(v),
                Arg::F32(spec.temperature),
                Arg::I32(radix),
                Arg::Ptr(wbuf),
                Arg::Ptr(sc),
            ],
        )?;
        if radix != 0 {
            for pass in 1..RADIX_PASSES as i32 {
                self.go(
                    &self.ck.sample_radix,
                    grid,
                    block,
                    0,
                    &[
                        Arg::Ptr(logits),
                        Arg::Ptr(wbuf),
                        Arg::I32(v),
                        Arg::F32(spec.top_p),
                        Arg::I32(pass),
                        Arg::Ptr(sc),
                    ],
                )?;
            }
        }
        self.go(
            &self.ck.sample_kept,
            grid,
            block,
            0,
            &[
                Arg::Ptr(logits),
                Arg::Ptr(wbuf),
                Arg::I32(v),
                Arg::F32(spec.top_p),
                Arg::F32(spec.min_p),
                Arg::I32(radix),
                Arg::Ptr(sc),
            ],
        )?;
        self.go(
            &self.ck.sample_draw,
            (1, 1, 1),
            (FIN_THREADS as u32, 1, 1),
            0,
            &[
                Arg::Ptr(logits),
                Arg::Ptr(wbuf),
                Arg::I32(v),
                Arg::F32(spec.temperature),
                Arg::F32(spec.top_p),
                Arg::F32(spec.min_p),
                Arg::I32(radix),
                Arg::U64(spec.seed),
                Arg::Ptr(sc),
                Arg::Ptr(ws.tok()),
                Arg::Ptr(ws.pos()),
                Arg::Ptr(self.ahead.ring.dev_ptr()),
                Arg::I32(super::ahead::RING_SLOTS as i32 - 1),
                Arg::Ptr(ws.hist.ptr()),
                Arg::I32(HIST_SLOTS as i32 - 1),
            ],
        )
    }

    /// Draws from `logits` with the device sampler, as the tail of the decode step at `pos`
    /// whose input token was `input` (the penalty window's newest id) would: the sampler alone,
    /// for tests over vocabularies and distributions a model would not give. Leaves the decode
    /// inputs at (drawn token, pos + 1), as a step does.
    pub fn sample_logits(
        &mut self,
        logits: &[f32],
        input: u32,
        pos: usize,
        spec: &SampleSpec,
    ) -> DResult<u32> {
        if logits.len() != self.spec.vocab {
            return Err(DevError(format!(
                "sample_logits: {} logits for a vocabulary of {}",
                logits.len(),
                self.spec.vocab
            )));
        }
        if let Some(why) = spec.validate().err().or_else(|| spec.device_limit()) {
            return Err(DevError(format!("sample_logits: {why}")));
        }
        if pos >= self.opts.max_context {
            return Err(DevError(format!(
                "sample_logits: position {pos} past the context of {}",
                self.opts.max_context
            )));
        }
        self.settle()?;
        self.dev_inputs = None;
        self.dev.upload_f32(self.ws.logits.ptr(), logits)?;
        self.dev
            .upload(self.ws.io.ptr(), bytes_of(&[input as i32, pos as i32]))?;
        self.enqueue_sample(&Sampler::Sample(*spec))?;
        self.dev.sync()?;
        let tok = self.ahead.ring.token_at(pos).ok_or_else(|| {
            DevError(format!(
                "the sampler's token for position {pos} is missing from the token ring"
            ))
        })?;
        self.dev_inputs = Some((tok, pos + 1));
        Ok(tok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::llm::kernels::SAMPLE;
    use crate::llm::sample::{draw_target, fixed, reaches, sample, uniform24};
    use crate::llm::synth::Rng;
    use std::ops::Range;

    /// The contiguous slice of the vocabulary that block `b` owns in every vocabulary pass (and in
    /// `topk_partial`): `⌈v / SAMPLE_BLOCKS⌉` tokens, the last ones shorter or empty.
    fn vocab_slice(v: usize, b: usize) -> Range<usize> {
        let per = v.div_ceil(SAMPLE_BLOCKS);
        let lo = (b * per).min(v);
        lo..(lo + per).min(v)
    }

    /// sample.cu's integer `#define`s and the value of a `SC_*` one (sums of products of
    /// integers and earlier names).
    fn cu_define(name: &str) -> usize {
        let line = SAMPLE
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name) && l.starts_with("#define"))
            .unwrap_or_else(|| panic!("#define {name} not in sample.cu"));
        let expr = line.split("//").next().unwrap().split_whitespace().skip(2);
        let expr: String = expr.collect::<Vec<_>>().join(" ");
        expr.trim_matches(|c| c == '(' || c == ')')
            .split('+')
            .map(|term| {
                term.split('*')
                    .map(|f| {
                        let f = f.trim();
                        f.parse::<usize>().unwrap_or_else(|_| cu_define(f))
                    })
                    .product::<usize>()
            })
            .sum()
    }

    #[test]
    fn scratch_layout_matches_sample_cu() {
        assert_eq!(cu_define("SAMPLE_BLOCKS"), SAMPLE_BLOCKS);
        assert_eq!(cu_define("TOPK_MAX"), super::super::workspace::TOPK_MAX);
        assert_eq!(cu_define("VOCAB_THREADS"), VOCAB_THREADS);
        assert_eq!(cu_define("FIN_THREADS"), FIN_THREADS);
        assert_eq!(cu_define("RADIX_PASSES"), RADIX_PASSES);
        assert_eq!(cu_define("RADIX_BINS"), RADIX_BINS);
        for (name, off) in [
            ("SC_HIST", 0),
            ("SC_TOTAL", sc::TOTAL),
            ("SC_MAX", sc::MAX),
            ("SC_PLAN", sc::PLAN),
            ("SC_ARG", sc::ARG),
            ("SC_KEPT", sc::KEPT),
            ("SC_TIES", sc::TIES),
            ("SC_WORDS", sc::WORDS),
        ] {
            assert_eq!(cu_define(name), off, "{name}");
        }
        assert_eq!(SCRATCH_BYTES, 8 * 6920);
    }

    #[test]
    fn slices_cover_the_vocabulary_in_order() {
        for v in [1, 2, 255, 256, 257, 300, 1000, 151_936, 151_937, 524_288] {
            let mut next = 0;
            for b in 0..SAMPLE_BLOCKS {
                let s = vocab_slice(v, b);
                assert_eq!(s.start, next, "v {v} block {b}");
                assert!(s.len() <= v.div_ceil(SAMPLE_BLOCKS));
                next = s.end;
            }
            assert_eq!(next, v, "v {v}");
        }
    }

    #[test]
    fn top_k_and_greedy_specs_take_the_merge() {
        let base = SampleSpec {
            temperature: 0.8,
            ..Default::default()
        };
        assert!(takes_vocab_passes(&base, 1000));
        for s in [
            SampleSpec { top_k: 40, ..base },
            SampleSpec { top_k: 1, ..base },
            SampleSpec {
                temperature: 0.0,
                ..base
            },
        ] {
            assert!(!takes_vocab_passes(&s, 1000), "{s:?}");
        }
        // Top-k at or past the vocabulary keeps everything: off.
        assert!(takes_vocab_passes(
            &SampleSpec {
                top_k: 1000,
                ..base
            },
            1000
        ));
    }

    // ---- a CPU model of the vocabulary passes --------------------------------------------

    fn order_key(l: f32) -> u32 {
        let mut u = l.to_bits();
        if u & 0x7fff_ffff == 0 {
            u = 0;
        }
        u = if u & 0x8000_0000 != 0 {
            !u
        } else {
            u | 0x8000_0000
        };
        !u
    }

    fn key_value(key: u32) -> f32 {
        let u = !key;
        f32::from_bits(if u & 0x8000_0000 != 0 {
            u & 0x7fff_ffff
        } else {
            !u
        })
    }

    fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
        v > bv || (v == bv && i < bi)
    }

    fn radix_shift(pass: usize) -> u32 {
        [21, 10, 0][pass]
    }

    fn radix_bins(pass: usize) -> usize {
        if pass == 2 {
            1024
        } else {
            2048
        }
    }

    /// (prefix, mask, weight before) as `radix_narrow` leaves it.
    #[derive(Clone, Copy, Default)]
    struct RadixState {
        prefix: u32,
        mask: u32,
        before: u64,
    }

    /// `radix_narrow`: the bins are scanned in the kernel's thread groups (each thread its
    /// contiguous bins, the group whose range crosses the target, then its first bin that does).
    fn radix_narrow(
        hist: &[u64],
        pass: usize,
        st: RadixState,
        top_p: f32,
        total: u64,
    ) -> RadixState {
        let nb = radix_bins(pass);
        let per = nb / VOCAB_THREADS;
        let (mut bin, mut before) = (nb - 1, st.before);
        let mut acc = st.before;
        for t in 0..VOCAB_THREADS {
            let group = &hist[t * per..(t + 1) * per];
            let mine: u64 = group.iter().sum();
            if !reaches(acc, top_p, total) && reaches(acc + mine, top_p, total) {
                let mut a = acc;
                for (j, &h) in group.iter().enumerate() {
                    if reaches(a + h, top_p, total) {
                        bin = t * per + j;
                        before = a;
                        break;
                    }
                    a += h;
                }
            }
            acc += mine;
        }
        let shift = radix_shift(pass);
        RadixState {
            prefix: st.prefix | (bin as u32) << shift,
            mask: st.mask | ((nb as u32 - 1) << shift),
            before,
        }
    }

    /// `ties_needed`.
    fn ties_needed(before: u64, wt: u64, all_ties: u64, top_p: f32, total: u64) -> u64 {
        let mut c = 1u64;
        if wt > 0 {
            let need = top_p as f64 * total as f64 - before as f64;
            c = if need > 0.0 {
                (need / wt as f64).ceil() as u64
            } else {
                1
            };
            c = c.max(1);
            while c > 1 && reaches(before + (c - 1) * wt, top_p, total) {
                c -= 1;
            }
            while c < all_ties && !reaches(before + c * wt, top_p, total) {
                c += 1;
            }
        }
        c.min(all_ties)
    }

    /// sample.cu's vocabulary chain on the CPU, kernel by kernel: what each block of a grid
    /// pass writes to the scratch, then sample_draw.
    fn vocab_chain(logits: &[f32], spec: &SampleSpec, pos: u64) -> u32 {
        let v = logits.len();
        let slices: Vec<Range<usize>> = (0..SAMPLE_BLOCKS).map(|b| vocab_slice(v, b)).collect();
        // sample_max
        let arg: Vec<(f32, u32)> = slices
            .iter()
            .map(|s| {
                let (mut bv, mut bi) = (f32::NEG_INFINITY, u32::MAX >> 1);
                for i in s.clone() {
                    let x = if logits[i].is_nan() {
                        f32::NEG_INFINITY
                    } else {
                        logits[i]
                    };
                    if better(x, i as u32, bv, bi) {
                        (bv, bi) = (x, i as u32);
                    }
                }
                (bv, bi)
            })
            .collect();
        let (mut m, mut best) = (f32::NEG_INFINITY, u32::MAX >> 1);
        for &(bv, bi) in &arg {
            if better(bv, bi, m, best) {
                (m, best) = (bv, bi);
            }
        }
        let best = if (best as usize) < v { best } else { 0 };
        if !m.is_finite() {
            return best;
        }
        // sample_weights
        let radix = spec.top_p < 1.0;
        let inv_t = 1.0 / spec.temperature;
        let wbuf: Vec<f32> = logits
            .iter()
            .map(|&l| {
                if l.is_nan() {
                    0.0
                } else {
                    ((l - m) * inv_t).exp()
                }
            })
            .collect();
        let total: u64 = wbuf.iter().map(|&e| fixed(e)).sum();
        // sample_weights (pass 0), sample_radix (1, 2), sample_kept's narrowing
        let mut st = RadixState::default();
        if radix {
            for pass in 0..RADIX_PASSES {
                let mut hist = vec![0u64; RADIX_BINS];
                let nb = radix_bins(pass) as u32;
                for (i, &l) in logits.iter().enumerate() {
                    let key = order_key(l);
                    let w = fixed(wbuf[i]);
                    if !l.is_nan() && key & st.mask == st.prefix && w > 0 {
                        hist[((key >> radix_shift(pass)) & (nb - 1)) as usize] += w;
                    }
                }
                st = radix_narrow(&hist, pass, st, spec.top_p, total);
            }
        }
        let cut = st.prefix;
        let min_p_ok = |e: f32| spec.min_p <= 0.0 || e >= spec.min_p;
        // sample_kept
        let (mut kept_b, mut ties_b) = (Vec::new(), Vec::new());
        for s in &slices {
            let (mut kept, mut ties) = (0u64, 0u64);
            for i in s.clone() {
                let l = logits[i];
                if l.is_nan() {
                    continue;
                }
                if radix {
                    let key = order_key(l);
                    if key == cut {
                        ties += 1;
                        continue;
                    }
                    if key > cut {
                        continue;
                    }
                }
                if min_p_ok(wbuf[i]) {
                    kept += fixed(wbuf[i]);
                }
            }
            kept_b.push(kept);
            ties_b.push(ties);
        }
        // sample_draw
        let (mut wt, mut ties_ok) = (0u64, false);
        if radix {
            let et = ((key_value(cut) - m) * inv_t).exp();
            wt = fixed(et);
            ties_ok = min_p_ok(et);
        }
        let all_ties: u64 = ties_b.iter().sum();
        let need = if radix {
            ties_needed(st.before, wt, all_ties, spec.top_p, total)
        } else {
            0
        };
        let mut ties_before = 0u64;
        let mut kb = Vec::new();
        let mut kt_b = Vec::new();
        for b in 0..SAMPLE_BLOCKS {
            let tb = ties_b[b];
            let kt = if need <= ties_before {
                0
            } else {
                (need - ties_before).min(tb)
            };
            kt_b.push(kt);
            kb.push(kept_b[b] + if ties_ok { kt * wt } else { 0 });
            ties_before += tb;
        }
        let kept: u64 = kb.iter().sum();
        if kept == 0 {
            return best;
        }
        let target = draw_target(uniform24(spec.seed, pos), kept);
        let mut acc = 0u64;
        let slice = (0..SAMPLE_BLOCKS)
            .find(|&b| {
                let hit = kb[b] > 0 && acc <= target && target < acc + kb[b];
                acc += kb[b];
                hit
            })
            .expect("a slice holds the target");
        let target = target - kb[..slice].iter().sum::<u64>();
        let (mut ties_seen, mut w_before) = (0u64, 0u64);
        for i in slices[slice].clone() {
            let l = logits[i];
            if l.is_nan() {
                continue;
            }
            let key = order_key(l);
            let tie = radix && key == cut;
            let mut keep = !radix || key < cut;
            if tie {
                keep = ties_seen < kt_b[slice];
                ties_seen += 1;
            }
            let w = if keep && min_p_ok(wbuf[i]) {
                fixed(wbuf[i])
            } else {
                0
            };
            if w > 0 && w_before <= target && target < w_before + w {
                return i as u32;
            }
            w_before += w;
        }
        panic!(
            "the slice's kept weight {} misses the target {target}",
            kb[slice]
        );
    }

    /// Checks the model against the host sampler for `specs` × `seeds` on `logits`.
    fn check(logits: &[f32], specs: &[SampleSpec], seeds: std::ops::Range<u64>) -> usize {
        let mut draws = std::collections::HashSet::new();
        for spec in specs {
            assert!(takes_vocab_passes(spec, logits.len()), "{spec:?}");
            for seed in seeds.clone() {
                let spec = SampleSpec { seed, ..*spec };
                let pos = seed * 7 + 3;
                let want = sample(&mut logits.to_vec(), &[], &spec, pos);
                let got = vocab_chain(logits, &spec, pos);
                assert_eq!(got, want, "v {} {spec:?} pos {pos}", logits.len());
                draws.insert(got);
            }
        }
        draws.len()
    }

    fn spec(temperature: f32, top_p: f32, min_p: f32) -> SampleSpec {
        SampleSpec {
            temperature,
            top_p,
            min_p,
            ..Default::default()
        }
    }

    fn random_logits(v: usize, scale: f32, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..v).map(|_| scale * rng.uniform()).collect()
    }

    #[test]
    fn vocab_passes_draw_the_host_token_on_a_flat_152k_vocabulary() {
        // Random weights' logits: top-p 0.9 keeps ~130k tokens, the cut far past the 64 best.
        for v in [151_936, 151_937] {
            let logits = random_logits(v, 0.05, v as u64);
            let specs = [
                spec(0.7, 0.9, 0.0),
                spec(1.0, 0.5, 0.0),
                spec(0.7, 1.0, 0.0),
            ];
            let seen = check(&logits, &specs, 0..4);
            assert!(seen >= 10, "draws are not spread: {seen}");
        }
    }

    #[test]
    fn vocab_passes_draw_the_host_token_on_peaked_and_tied_logits() {
        let v = 4099; // not a multiple of the slices
        let specs = [
            spec(0.7, 0.9, 0.0),
            spec(1.0, 0.95, 0.0),
            spec(0.05, 0.9, 0.0),
            spec(4.0, 0.3, 0.0),
            spec(1.0, 0.001, 0.0),
            spec(1.5, 1.0, 0.05),
            spec(1.0, 0.8, 0.2),
            spec(3.0, 0.6, 0.05),
            SampleSpec {
                top_k: v,
                ..spec(1.0, 0.9, 0.0)
            },
        ];
        // Peaked (a model's usual shape), then heavy ties: logits in steps of 0.25, so cuts
        // fall inside runs of equal logits spread over many slices.
        let peaked = random_logits(v, 3.0, 1);
        assert!(check(&peaked, &specs, 0..12) > 8);
        let mut rng = Rng::new(2);
        let tied: Vec<f32> = (0..v)
            .map(|_| (rng.uniform() * 2.0 / 0.25).round() * 0.25)
            .collect();
        assert!(check(&tied, &specs, 0..12) > 8);
        // Every logit equal: one key, the cut counts ties across every slice.
        check(&vec![0.5; v], &specs, 0..12);
    }

    #[test]
    fn vocab_passes_skip_nan_and_take_the_host_fallbacks() {
        let specs = [
            spec(1.0, 0.9, 0.0),
            spec(0.8, 1.0, 0.1),
            spec(2.0, 0.5, 0.0),
        ];
        let mut logits = random_logits(1000, 1.0, 3);
        for i in (0..1000).step_by(7) {
            logits[i] = f32::NAN;
        }
        for i in (3..1000).step_by(11) {
            logits[i] = f32::NEG_INFINITY;
        }
        for i in (5..1000).step_by(13) {
            logits[i] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        assert!(check(&logits, &specs, 0..16) > 5);
        // All NaN, all −inf, one +inf, a lone finite logit among NaN: the arg-max.
        check(&vec![f32::NAN; 300], &specs, 0..3);
        check(&vec![f32::NEG_INFINITY; 300], &specs, 0..3);
        let mut inf = random_logits(300, 1.0, 4);
        inf[123] = f32::INFINITY;
        check(&inf, &specs, 0..3);
        let mut lone = vec![f32::NAN; 300];
        lone[299] = -2.0;
        check(&lone, &specs, 0..3);
        // Tiny vocabularies: most slices empty.
        for v in [1, 2, 3, 255, 257] {
            check(&random_logits(v, 1.0, v as u64), &specs, 0..6);
        }
    }
}
