//! Per-stage device timings of one layer, for finding where a token's time goes (the bench's
//! `--profile`). Each stage is launched alone `iters` times between CUDA events, after one
//! warm-up; values it writes are garbage afterwards, so call this only after the measurements
//! that need the model's state.

use super::{AttnKernel, CudaLlm};
use crate::cuda::runtime::device::{DResult, Timer};
use crate::llm::sample::SampleSpec;
use crate::llm::Sampler;

impl CudaLlm {
    fn time_ms(&self, iters: usize, mut f: impl FnMut() -> DResult<()>) -> DResult<f64> {
        f()?;
        let t = Timer::new()?;
        t.start(&self.dev)?;
        for _ in 0..iters {
            f()?;
        }
        Ok(t.stop_ms(&self.dev)? as f64 / iters as f64)
    }

    /// (stage, µs) for layer 0 of a decode step at the device's current position, the head,
    /// the sampler, and a replay of the whole-token graph. Needs a decode step run before.
    pub fn profile_decode(&mut self, iters: usize) -> DResult<Vec<(String, f64)>> {
        let mut out = Vec::new();
        // The stages as the graph for the device's position runs them.
        let next = self.ahead.in_flight.map(|f| f.pos + 1);
        self.settle()?;
        let short = next
            .or(self.dev_inputs.map(|(_, p)| p))
            .is_some_and(|p| self.short_graph_at(p));
        self.enqueue_short.set(short);
        for (st, name) in Self::DECODE_STAGES.iter().enumerate() {
            out.push((
                format!("decode layer: {name}"),
                1e3 * self.time_ms(iters, || self.decode_stage(0, st))?,
            ));
        }
        let all = self.time_ms(iters, || {
            (0..Self::DECODE_STAGES.len()).try_for_each(|st| self.decode_stage(0, st))
        })?;
        out.push(("decode layer: all stages back to back".into(), 1e3 * all));
        let lm = self.time_ms(iters, || {
            self.enqueue_head_decode(self.ws.h.ptr(), self.ws.logits.ptr())
        })?;
        out.push(("decode head: final norm + lm_head matvec".into(), 1e3 * lm));
        let sample = self.time_ms(iters, || self.enqueue_sample(&Sampler::Greedy))?;
        out.push(("decode head: greedy sampler".into(), 1e3 * sample));
        // The vocabulary passes with top-p's radix select (sampler.rs), on this step's logits.
        let nucleus = Sampler::Sample(SampleSpec {
            temperature: 0.7,
            top_p: 0.9,
            ..SampleSpec::default()
        });
        let sample = self.time_ms(iters, || self.enqueue_sample(&nucleus))?;
        out.push((
            "decode head: sampler, temperature 0.7, top-p 0.9".into(),
            1e3 * sample,
        ));
        self.enqueue_short.set(false);
        if let Some((_, g)) = &self.graphs[short as usize] {
            // Each replay advances the device position by one: a few only.
            let n = iters.min(8);
            let t = Timer::new()?;
            t.start(&self.dev)?;
            for _ in 0..n {
                g.launch()?;
            }
            out.push((
                "whole-token graph replay (device time)".into(),
                1e3 * t.stop_ms(&self.dev)? as f64 / n as f64,
            ));
            self.dev_inputs = None;
        }
        Ok(out)
    }

    /// (stage, µs) for layer 0 of a prefill of `t` tokens at position 0 (a prefill of at
    /// least `t` tokens must have run), with every available attention kernel.
    pub fn profile_prefill(&mut self, t: usize, iters: usize) -> DResult<Vec<(String, f64)>> {
        let mut out = Vec::new();
        for (st, name) in Self::PREFILL_STAGES.iter().enumerate() {
            if st == 3 {
                let keep = self.attn;
                for k in [AttnKernel::Fa2, AttnKernel::Simple] {
                    self.set_attention(k);
                    if self.attn != k || (k == AttnKernel::Simple && t > 1024) {
                        continue;
                    }
                    let ms = self.time_ms(iters, || self.prefill_stage(0, t, st))?;
                    out.push((format!("prefill layer: attention {k:?}"), 1e3 * ms));
                }
                self.attn = keep;
                continue;
            }
            out.push((
                format!("prefill layer: {name}"),
                1e3 * self.time_ms(iters, || self.prefill_stage(0, t, st))?,
            ));
        }
        Ok(out)
    }
}
