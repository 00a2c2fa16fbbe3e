//! Z-Image-Turbo text-to-image, on the CPU and (through cmf-gpu's facade) on a GPU.
//!
//! One model part per file, each matching its diffusers/transformers reference:
//! - [`text_encoder`]: Qwen3 chat template + tokenizer → `hidden_states[-2]` (via cmf-llm),
//! - [`transformer`]: the DiT (`ZImageTransformer2DModel`),
//! - [`denoiser`]: the DiT on the device when one takes it, with the CPU as the fallback,
//! - [`vae`]: the FLUX `AutoencoderKL` decoder,
//! - [`scheduler`]: the flow-matching Euler schedule with a static shift,
//! - [`noise`]: the seeded Gaussian generator and `--latents` files,
//! - [`pipeline`]: the whole run (CFG batching, timings, PNG output).
//!
//! Weights are read in place from a CMF pack laid out as the reference project lays it out
//! (`dit.*`, `te.*`, `vae.decoder.*`, JSON blobs; see docs/zimage.md) through [`tensors`].

pub mod denoiser;
pub mod error;
pub mod noise;
pub mod ops;
pub mod pipeline;
pub mod scheduler;
pub mod tensors;
pub mod text_encoder;
pub mod transformer;
pub mod vae;

pub use error::ZimageError;
