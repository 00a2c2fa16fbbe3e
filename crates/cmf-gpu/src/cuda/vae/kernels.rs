//! The VAE decoder's kernels: its own module (`kernels/vae.cu`) and the runtime's row kernels.

use crate::cuda::runtime::device::{DResult, Dev, DevError};
use crate::cuda::runtime::kernels::{Func, Job, Module, ROWOPS};

pub const VAE: &str = include_str!("kernels/vae.cu");

pub(super) struct Kernels {
    pub(super) dequant_rows: Func,
    pub(super) to_bf16: Func,
    pub(super) nchw_to_nhwc: Func,
    pub(super) permute_taps: Func,
    pub(super) gn_stats: [Func; 2],
    pub(super) gn_finalize: Func,
    pub(super) gn_apply: [Func; 2],
    pub(super) im2col3: Func,
    pub(super) bias_res: [Func; 2],
    pub(super) bias_bf16: Func,
    pub(super) softmax_rows: Func,
    pub(super) conv3_small: Func,
    pub(super) upsample2: Func,
    _mods: Vec<Module>,
}

impl Kernels {
    pub(super) fn load(dev: &Dev) -> DResult<Kernels> {
        // rowops with its default defines: only the geometry-free kernels are used here.
        let arch = dev.arch();
        let [rows, vae]: [Module; 2] = Module::load_all(
            dev,
            &[
                Job::new("rowops", ROWOPS, &[], &arch),
                Job::new("vae", VAE, &[], &arch),
            ],
        )?
        .try_into()
        .map_err(|_| DevError("VAE kernels: two modules expected".into()))?;
        Ok(Kernels {
            dequant_rows: rows.func("dequant_rows")?,
            to_bf16: rows.func("to_bf16")?,
            nchw_to_nhwc: vae.func("vae_nchw_to_nhwc_bf16")?,
            permute_taps: vae.func("vae_permute_taps")?,
            gn_stats: [vae.func("vae_gn_stats")?, vae.func("vae_gn_stats_bf16")?],
            gn_finalize: vae.func("vae_gn_finalize")?,
            gn_apply: [vae.func("vae_gn_apply")?, vae.func("vae_gn_apply_bf16")?],
            im2col3: vae.func("vae_im2col3")?,
            bias_res: [vae.func("vae_bias_res")?, vae.func("vae_bias_res_bf16")?],
            bias_bf16: vae.func("vae_bias_bf16")?,
            softmax_rows: vae.func("vae_softmax_rows")?,
            conv3_small: vae.func("vae_conv3_small")?,
            upsample2: vae.func("vae_upsample2_bf16")?,
            _mods: vec![rows, vae],
        })
    }
}
