//! Random-weight models of any geometry and codec, for parity tests and benchmarks.
//!
//! The bytes are valid codec payloads drawn directly (random int8/nibbles with positive f16
//! scales, random bf16/f16/f32 values), scaled so activations stay O(1) through many layers.
//! Generation is parallel and deterministic in (seed, chunk), so an 8B-geometry model takes
//! seconds on a many-core host.

use super::{AttentionWeights, Ffn, LayerWeights, LlmModel, LlmSpec, Mixer, Mlp, RopeSpec};
use cmf_format::Dtype;
use cmf_kernels::Weight;
use half::{bf16, f16};

/// A small counter-based generator (splitmix64): good enough for test data, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// Fills `buf` with `f(rng, chunk)` per chunk of about 1 MiB (a multiple of `unit` bytes, so
/// no element or tile straddles two chunks), on all cores; chunk i uses seed (seed, i).
fn par_fill(buf: &mut [u8], unit: usize, seed: u64, f: impl Fn(&mut Rng, &mut [u8]) + Sync) {
    let chunk_bytes = (1usize << 20) / unit * unit;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let chunks: Vec<(usize, &mut [u8])> = buf.chunks_mut(chunk_bytes).enumerate().collect();
    let per = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [u8])>> = Vec::new();
    let mut it = chunks.into_iter();
    loop {
        let g: Vec<_> = it.by_ref().take(per).collect();
        if g.is_empty() {
            break;
        }
        groups.push(g);
    }
    std::thread::scope(|s| {
        for g in groups {
            let f = &f;
            s.spawn(move || {
                for (i, c) in g {
                    let mut rng = Rng::new(seed.wrapping_mul(0x1000_0001).wrapping_add(i as u64));
                    f(&mut rng, c);
                }
            });
        }
    });
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// A random `[rows, cols]` matrix in `dtype` whose values have standard deviation ≈ `std`.
pub fn random_matrix(dtype: Dtype, rows: usize, cols: usize, std: f32, seed: u64) -> Vec<u8> {
    let n = rows * cols;
    let nbytes = dtype
        .expected_nbytes(&[rows as u64, cols as u64])
        .expect("codec/shape") as usize;
    let mut out = vec![0u8; nbytes];
    // Uniform in [-a, a) has std a/√3.
    let a = std * 3f32.sqrt();
    match dtype {
        Dtype::F32 => par_fill(&mut out, 4, seed, |r, c| {
            c.chunks_exact_mut(4)
                .for_each(|b| b.copy_from_slice(&(r.uniform() * a).to_le_bytes()))
        }),
        Dtype::F16 => par_fill(&mut out, 2, seed, |r, c| {
            c.chunks_exact_mut(2)
                .for_each(|b| b.copy_from_slice(&f16_bytes(r.uniform() * a)))
        }),
        Dtype::Bf16 => par_fill(&mut out, 2, seed, |r, c| {
            c.chunks_exact_mut(2)
                .for_each(|b| b.copy_from_slice(&bf16::from_f32(r.uniform() * a).to_le_bytes()))
        }),
        Dtype::Q8Row | Dtype::Q8_2f => {
            let (q, rest) = out.split_at_mut(n);
            par_fill(q, 1, seed, |r, c| {
                c.iter_mut()
                    .for_each(|b| *b = (r.next_u64() % 255) as u8 ^ 0x80)
            });
            // q ~ U[-127, 127] has std ≈ 73.6: row scale ≈ std / 73.6, jittered ±25 %.
            let mut rng = Rng::new(seed ^ 0x51);
            for s in rest[..rows * 2].chunks_exact_mut(2) {
                s.copy_from_slice(&f16_bytes(std / 73.6 * (1.0 + 0.25 * rng.uniform())));
            }
            for s in rest[rows * 2..].chunks_exact_mut(2) {
                s.copy_from_slice(&f16_bytes(1.0 + 0.5 * rng.uniform()));
            }
        }
        Dtype::Q4Block | Dtype::Q4Tiled => {
            // (q − 8)·s with q ~ U[0, 15] has std ≈ 4.6·s.
            let s = std / 4.6;
            match dtype {
                Dtype::Q4Block => {
                    let groups = n.div_ceil(32);
                    let (nib, scales) = out.split_at_mut(groups * 16);
                    par_fill(nib, 1, seed, |r, c| {
                        c.iter_mut().for_each(|b| *b = r.next_u64() as u8)
                    });
                    let mut rng = Rng::new(seed ^ 0x52);
                    for b in scales.chunks_exact_mut(2) {
                        b.copy_from_slice(&f16_bytes(s * (1.0 + 0.25 * rng.uniform())));
                    }
                }
                _ => par_fill(&mut out, 18, seed, |r, c| {
                    for t in c.chunks_exact_mut(18) {
                        t[..2].copy_from_slice(&f16_bytes(s * (1.0 + 0.25 * r.uniform())));
                        t[2..].iter_mut().for_each(|b| *b = r.next_u64() as u8);
                    }
                }),
            }
        }
        other => panic!("random_matrix: {other} is not a matrix codec"),
    }
    out
}

/// Qwen3-style spec: rope θ = 1e6 over the whole head, no sliding window.
#[allow(clippy::too_many_arguments)]
pub fn qwen3_spec(
    hidden: usize,
    intermediate: usize,
    num_layers: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    vocab: usize,
) -> LlmSpec {
    let half = head_dim / 2;
    let inv_freq = (0..half)
        .map(|i| 1.0 / 1_000_000f64.powf(2.0 * i as f64 / head_dim as f64) as f32)
        .collect();
    LlmSpec {
        hidden,
        intermediate,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab,
        rms_eps: 1e-6,
        rope: RopeSpec {
            inv_freq,
            attention_factor: 1.0,
        },
        sliding_window: vec![None; num_layers],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        norm_style: crate::llm::NormStyle::Plain,
    }
}

/// Geometry of Qwen3-0.6B (28 layers, tied embeddings).
pub fn qwen3_0_6b() -> LlmSpec {
    qwen3_spec(1024, 3072, 28, 16, 8, 128, 151_936)
}

/// Geometry of Qwen3-8B (36 layers, untied lm_head).
pub fn qwen3_8b() -> LlmSpec {
    qwen3_spec(4096, 12_288, 36, 32, 8, 128, 151_936)
}

/// Which optional tensors a synthetic model carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthOptions {
    /// Qwen3 per-head q/k RMSNorm.
    pub qk_norm: bool,
    /// Qwen2 q/k/v biases.
    pub qkv_bias: bool,
    /// lm_head is the embedding.
    pub tied: bool,
}

impl SynthOptions {
    pub const QWEN3: SynthOptions = SynthOptions {
        qk_norm: true,
        qkv_bias: false,
        tied: false,
    };
}

struct SynthLayer {
    m: [Vec<u8>; 7],
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    bias: Option<[Vec<f32>; 3]>,
    qk_norm: Option<[Vec<f32>; 2]>,
}

/// A random model that owns its bytes; [`SynthModel::model`] borrows it as an [`LlmModel`].
pub struct SynthModel {
    pub spec: LlmSpec,
    pub dtype: Dtype,
    embed: Vec<u8>,
    lm_head: Option<Vec<u8>>,
    final_norm: Vec<f32>,
    layers: Vec<SynthLayer>,
}

impl SynthModel {
    /// Every matrix in `dtype` (the embedding too).
    pub fn new(spec: LlmSpec, dtype: Dtype, opts: SynthOptions, seed: u64) -> SynthModel {
        let (h, i, q, kv, d) = (
            spec.hidden,
            spec.intermediate,
            spec.q_dim(),
            spec.kv_dim(),
            spec.head_dim,
        );
        let mut rng = Rng::new(seed);
        let norm = |rng: &mut Rng, n: usize| -> Vec<f32> {
            (0..n).map(|_| 1.0 + 0.2 * rng.uniform()).collect()
        };
        let std_in = |cols: usize| 1.0 / (cols as f32).sqrt();
        let mut next = seed;
        let mut mat = |rows: usize, cols: usize, std: f32| {
            next = next.wrapping_add(0x1_0000);
            random_matrix(dtype, rows, cols, std, next)
        };
        let layers = (0..spec.num_layers)
            .map(|_| SynthLayer {
                m: [
                    mat(q, h, std_in(h)),
                    mat(kv, h, std_in(h)),
                    mat(kv, h, std_in(h)),
                    mat(h, q, 0.5 * std_in(q)),
                    mat(i, h, std_in(h)),
                    mat(i, h, std_in(h)),
                    mat(h, i, 0.5 * std_in(i)),
                ],
                attn_norm: norm(&mut rng, h),
                ffn_norm: norm(&mut rng, h),
                bias: opts
                    .qkv_bias
                    .then(|| [rng.vec(q, 0.5), rng.vec(kv, 0.5), rng.vec(kv, 0.5)]),
                qk_norm: opts.qk_norm.then(|| [norm(&mut rng, d), norm(&mut rng, d)]),
            })
            .collect();
        let embed = mat(spec.vocab, h, 1.0);
        let lm_head = (!opts.tied).then(|| mat(spec.vocab, h, std_in(h)));
        SynthModel {
            final_norm: norm(&mut rng, h),
            spec,
            dtype,
            embed,
            lm_head,
            layers,
        }
    }

    /// Bytes of all matrices (each counted once).
    pub fn weight_bytes(&self) -> u64 {
        let l: usize = self
            .layers
            .iter()
            .flat_map(|l| l.m.iter())
            .map(|m| m.len())
            .sum();
        (l + self.embed.len() + self.lm_head.as_ref().map_or(0, |m| m.len())) as u64
    }

    /// Matrix bytes one decode step reads: every layer matrix and the lm_head (not the
    /// embedding, of which it reads one row).
    pub fn bytes_per_token(&self) -> u64 {
        let l: usize = self
            .layers
            .iter()
            .flat_map(|l| l.m.iter())
            .map(|m| m.len())
            .sum();
        (l + self.lm_head.as_ref().unwrap_or(&self.embed).len()) as u64
    }

    pub fn model(&self) -> LlmModel<'_> {
        let s = &self.spec;
        let dtype = self.dtype;
        fn w(dtype: Dtype, data: &[u8], rows: usize, cols: usize) -> Weight<'_> {
            Weight {
                dtype,
                rows,
                cols,
                data,
            }
        }
        let w = |data, rows, cols| w(dtype, data, rows, cols);
        let (h, i, q, kv) = (s.hidden, s.intermediate, s.q_dim(), s.kv_dim());
        let layers = self
            .layers
            .iter()
            .map(|l| LayerWeights {
                attn_norm: &l.attn_norm,
                mixer: Mixer::Attention(AttentionWeights {
                    q: w(&l.m[0], q, h),
                    k: w(&l.m[1], kv, h),
                    v: w(&l.m[2], kv, h),
                    o: w(&l.m[3], h, q),
                    q_bias: l.bias.as_ref().map(|b| b[0].as_slice()),
                    k_bias: l.bias.as_ref().map(|b| b[1].as_slice()),
                    v_bias: l.bias.as_ref().map(|b| b[2].as_slice()),
                    q_norm: l.qk_norm.as_ref().map(|b| b[0].as_slice()),
                    k_norm: l.qk_norm.as_ref().map(|b| b[1].as_slice()),
                    output_gate: false,
                }),
                ffn_norm: &l.ffn_norm,
                ffn: Ffn::Dense(Mlp {
                    gate: w(&l.m[4], i, h),
                    up: w(&l.m[5], i, h),
                    down: w(&l.m[6], h, i),
                }),
            })
            .collect();
        let embed = w(&self.embed, s.vocab, h);
        LlmModel {
            spec: s.clone(),
            embed,
            layers,
            final_norm: &self.final_norm,
            lm_head: self.lm_head.as_deref().map_or(embed, |m| w(m, s.vocab, h)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_matrices_are_valid_and_deterministic() {
        for d in [
            Dtype::F32,
            Dtype::F16,
            Dtype::Bf16,
            Dtype::Q8Row,
            Dtype::Q8_2f,
            Dtype::Q4Block,
            Dtype::Q4Tiled,
        ] {
            let a = random_matrix(d, 8, 64, 0.1, 7);
            assert_eq!(a.len() as u64, d.expected_nbytes(&[8, 64]).unwrap());
            assert_eq!(a, random_matrix(d, 8, 64, 0.1, 7), "{d}");
            let w = Weight {
                dtype: d,
                rows: 8,
                cols: 64,
                data: &a,
            };
            let mut row = vec![0f32; 64];
            let mut ss = 0.0;
            for r in 0..8 {
                cmf_kernels::reference::decode_row(&w, r, &mut row);
                ss += row.iter().map(|v| v * v).sum::<f32>();
            }
            let std = (ss / 512.0).sqrt();
            assert!((0.05..0.2).contains(&std), "{d}: std {std}");
        }
    }

    #[test]
    fn synth_model_validates() {
        let spec = qwen3_spec(64, 96, 2, 4, 2, 16, 50);
        for tied in [false, true] {
            let m = SynthModel::new(
                spec.clone(),
                Dtype::Q8Row,
                SynthOptions {
                    tied,
                    ..SynthOptions::QWEN3
                },
                1,
            );
            m.model().validate().unwrap();
            assert_eq!(m.model().head_is_tied(), tied);
        }
    }
}
