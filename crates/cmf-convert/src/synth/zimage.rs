//! `cmf synth --preset z-image-turbo`: a random-weight Z-Image-Turbo pack with the real geometry
//! and the layout `cmf convert --zimage` writes (see `crate::zimage`), for benchmarks.
//!
//! Geometry: the DiT of `ZImageTransformer2DModel`'s defaults (dim 3840, 30 layers, 2 + 2 refiner
//! blocks, 30 heads, FFN 10240, caption features 2560), Qwen3-4B's text encoder cut after layer
//! 35 of 36 (as packed: `hidden_states[-2]`), the FLUX.1 VAE decoder (block_out 128/256/512/512,
//! 2 layers per block, 32 groups, 16 latent channels).
//!
//! Codecs as the converter chooses them: DiT and TE projections follow `--quant` (benchmarks use
//! q8_2f, the converter's default), `adaLN_modulation.0.weight` f16, `te.embed_tokens` q8_row,
//! `te.layers.6.mlp.down_proj` bf16 (the reference keeps it at the source precision, bf16 in the
//! published text encoder), everything else — and the whole VAE — f32.

use cmf_format::{Arch, Dtype, Header, LayerType, QuantType, TokenizerConfig};
use serde_json::json;

use super::{tokenizer, Init, SynthArgs, SynthSpec, SynthTensor};
use crate::error::Result;

const STD: f32 = 0.02;

/// Z-Image DiT geometry (diffusers `ZImageTransformer2DModel` defaults).
const DIM: usize = 3840;
const LAYERS: usize = 30;
const REFINERS: usize = 2;
const HEADS: usize = 30;
const FFN: usize = 10240;
const CAP: usize = 2560;
const ADALN: usize = 256;
/// Qwen3-4B.
const TE_LAYERS_SRC: usize = 36;
const TE_HEADS: usize = 32;
const TE_KV: usize = 8;
const TE_HD: usize = 128;
const TE_FFN: usize = 9728;
const VOCAB: usize = 151936;
/// FLUX.1 VAE.
const VAE_BLOCKS: [usize; 4] = [128, 256, 512, 512];
const VAE_GROUPS: usize = 32;
const LATENT: usize = 16;

fn t(name: String, shape: Vec<usize>, init: Init, dtype: Option<Dtype>) -> SynthTensor {
    SynthTensor {
        name,
        shape,
        init,
        dtype,
    }
}

fn dit_tensors(v: &mut Vec<SynthTensor>) {
    let n = Init::Normal { std: STD };
    let one = Init::Const(1.0);
    let zero = Init::Const(0.0);
    let f32_ = Some(Dtype::F32);
    let block = |v: &mut Vec<SynthTensor>, p: &str, modulated: bool| {
        for q in ["to_q", "to_k", "to_v", "to_out.0"] {
            v.push(t(
                format!("dit.{p}.attention.{q}.weight"),
                vec![DIM, DIM],
                n,
                None,
            ));
        }
        for q in ["norm_q", "norm_k"] {
            v.push(t(
                format!("dit.{p}.attention.{q}.weight"),
                vec![DIM / HEADS],
                one,
                None,
            ));
        }
        for q in [
            "attention_norm1",
            "attention_norm2",
            "ffn_norm1",
            "ffn_norm2",
        ] {
            v.push(t(format!("dit.{p}.{q}.weight"), vec![DIM], one, None));
        }
        v.push(t(
            format!("dit.{p}.feed_forward.w1.weight"),
            vec![FFN, DIM],
            n,
            None,
        ));
        v.push(t(
            format!("dit.{p}.feed_forward.w2.weight"),
            vec![DIM, FFN],
            n,
            None,
        ));
        v.push(t(
            format!("dit.{p}.feed_forward.w3.weight"),
            vec![FFN, DIM],
            n,
            None,
        ));
        if modulated {
            v.push(t(
                format!("dit.{p}.adaLN_modulation.0.weight"),
                vec![4 * DIM, ADALN],
                n,
                Some(Dtype::F16),
            ));
            v.push(t(
                format!("dit.{p}.adaLN_modulation.0.bias"),
                vec![4 * DIM],
                zero,
                None,
            ));
        }
    };
    v.push(t(
        "dit.all_x_embedder.2-1.weight".into(),
        vec![DIM, 4 * LATENT],
        n,
        f32_,
    ));
    v.push(t(
        "dit.all_x_embedder.2-1.bias".into(),
        vec![DIM],
        zero,
        None,
    ));
    v.push(t("dit.x_pad_token".into(), vec![1, DIM], n, f32_));
    v.push(t("dit.cap_pad_token".into(), vec![1, DIM], n, f32_));
    v.push(t(
        "dit.t_embedder.mlp.0.weight".into(),
        vec![1024, 256],
        n,
        f32_,
    ));
    v.push(t(
        "dit.t_embedder.mlp.0.bias".into(),
        vec![1024],
        zero,
        None,
    ));
    v.push(t(
        "dit.t_embedder.mlp.2.weight".into(),
        vec![ADALN, 1024],
        n,
        f32_,
    ));
    v.push(t(
        "dit.t_embedder.mlp.2.bias".into(),
        vec![ADALN],
        zero,
        None,
    ));
    v.push(t("dit.cap_embedder.0.weight".into(), vec![CAP], one, None));
    v.push(t(
        "dit.cap_embedder.1.weight".into(),
        vec![DIM, CAP],
        n,
        None,
    ));
    v.push(t("dit.cap_embedder.1.bias".into(), vec![DIM], zero, None));
    for i in 0..REFINERS {
        block(v, &format!("noise_refiner.{i}"), true);
    }
    for i in 0..REFINERS {
        block(v, &format!("context_refiner.{i}"), false);
    }
    for i in 0..LAYERS {
        block(v, &format!("layers.{i}"), true);
    }
    v.push(t(
        "dit.all_final_layer.2-1.adaLN_modulation.1.weight".into(),
        vec![DIM, ADALN],
        n,
        f32_,
    ));
    v.push(t(
        "dit.all_final_layer.2-1.adaLN_modulation.1.bias".into(),
        vec![DIM],
        zero,
        None,
    ));
    v.push(t(
        "dit.all_final_layer.2-1.linear.weight".into(),
        vec![4 * LATENT, DIM],
        n,
        f32_,
    ));
    v.push(t(
        "dit.all_final_layer.2-1.linear.bias".into(),
        vec![4 * LATENT],
        zero,
        None,
    ));
}

fn te_tensors(v: &mut Vec<SynthTensor>) {
    let n = Init::Normal { std: STD };
    let one = Init::Const(1.0);
    let (q, kv) = (TE_HEADS * TE_HD, TE_KV * TE_HD);
    v.push(t(
        "te.embed_tokens.weight".into(),
        vec![VOCAB, CAP],
        n,
        Some(Dtype::Q8Row),
    ));
    for i in 0..TE_LAYERS_SRC - 1 {
        let p = |s: &str| format!("te.layers.{i}.{s}");
        v.push(t(p("input_layernorm.weight"), vec![CAP], one, None));
        v.push(t(p("self_attn.q_proj.weight"), vec![q, CAP], n, None));
        v.push(t(p("self_attn.k_proj.weight"), vec![kv, CAP], n, None));
        v.push(t(p("self_attn.v_proj.weight"), vec![kv, CAP], n, None));
        v.push(t(p("self_attn.q_norm.weight"), vec![TE_HD], one, None));
        v.push(t(p("self_attn.k_norm.weight"), vec![TE_HD], one, None));
        v.push(t(p("self_attn.o_proj.weight"), vec![CAP, q], n, None));
        v.push(t(
            p("post_attention_layernorm.weight"),
            vec![CAP],
            one,
            None,
        ));
        v.push(t(p("mlp.gate_proj.weight"), vec![TE_FFN, CAP], n, None));
        v.push(t(p("mlp.up_proj.weight"), vec![TE_FFN, CAP], n, None));
        let down = if i == 6 { Some(Dtype::Bf16) } else { None };
        v.push(t(p("mlp.down_proj.weight"), vec![CAP, TE_FFN], n, down));
    }
}

fn vae_tensors(v: &mut Vec<SynthTensor>) {
    let n = Init::Normal { std: STD };
    let f32_ = Some(Dtype::F32);
    let conv = |v: &mut Vec<SynthTensor>, name: String, cin: usize, cout: usize, k: usize| {
        v.push(t(format!("{name}.weight"), vec![cout, cin, k, k], n, f32_));
        v.push(t(
            format!("{name}.bias"),
            vec![cout],
            Init::Const(0.0),
            None,
        ));
    };
    let gn = |v: &mut Vec<SynthTensor>, name: String, c: usize| {
        v.push(t(format!("{name}.weight"), vec![c], Init::Const(1.0), None));
        v.push(t(format!("{name}.bias"), vec![c], Init::Const(0.0), None));
    };
    let resnet = |v: &mut Vec<SynthTensor>, p: String, cin: usize, cout: usize| {
        gn(v, format!("{p}.norm1"), cin);
        conv(v, format!("{p}.conv1"), cin, cout, 3);
        gn(v, format!("{p}.norm2"), cout);
        conv(v, format!("{p}.conv2"), cout, cout, 3);
        if cin != cout {
            conv(v, format!("{p}.conv_shortcut"), cin, cout, 1);
        }
    };
    let top = VAE_BLOCKS[3];
    conv(v, "vae.decoder.conv_in".into(), LATENT, top, 3);
    resnet(v, "vae.decoder.mid_block.resnets.0".into(), top, top);
    gn(
        v,
        "vae.decoder.mid_block.attentions.0.group_norm".into(),
        top,
    );
    for q in ["to_q", "to_k", "to_v", "to_out.0"] {
        v.push(t(
            format!("vae.decoder.mid_block.attentions.0.{q}.weight"),
            vec![top, top],
            n,
            f32_,
        ));
        v.push(t(
            format!("vae.decoder.mid_block.attentions.0.{q}.bias"),
            vec![top],
            Init::Const(0.0),
            None,
        ));
    }
    resnet(v, "vae.decoder.mid_block.resnets.1".into(), top, top);
    let rev: Vec<usize> = VAE_BLOCKS.iter().rev().copied().collect();
    let mut prev = rev[0];
    for (i, &out) in rev.iter().enumerate() {
        for j in 0..3 {
            resnet(
                v,
                format!("vae.decoder.up_blocks.{i}.resnets.{j}"),
                if j == 0 { prev } else { out },
                out,
            );
        }
        if i + 1 < rev.len() {
            conv(
                v,
                format!("vae.decoder.up_blocks.{i}.upsamplers.0.conv"),
                out,
                out,
                3,
            );
        }
        prev = out;
    }
    gn(v, "vae.decoder.conv_norm_out".into(), VAE_BLOCKS[0]);
    conv(v, "vae.decoder.conv_out".into(), VAE_BLOCKS[0], 3, 3);
}

/// The JSON blobs of a Z-Image-Turbo pack (the published configs, with the text encoder cut).
fn blobs() -> Vec<(String, Vec<u8>)> {
    let dit = json!({
        "_class_name": "ZImageTransformer2DModel", "all_patch_size": [2], "all_f_patch_size": [1],
        "in_channels": LATENT, "dim": DIM, "n_layers": LAYERS, "n_refiner_layers": REFINERS,
        "n_heads": HEADS, "n_kv_heads": HEADS, "norm_eps": 1e-5, "qk_norm": true, "cap_feat_dim": CAP,
        "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1024, 512, 512]
    });
    let te = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": CAP,
        "intermediate_size": TE_FFN, "num_hidden_layers": TE_LAYERS_SRC - 1, "num_attention_heads": TE_HEADS,
        "num_key_value_heads": TE_KV, "head_dim": TE_HD, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": true,
        "vocab_size": VOCAB, "attention_bias": false, "final_norm": false,
        "cortiq_tap": "hidden_states[-2] of the source (no final norm)"
    });
    let vae = json!({
        "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": LATENT,
        "block_out_channels": VAE_BLOCKS, "layers_per_block": 2, "norm_num_groups": VAE_GROUPS,
        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"], "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
        "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": false,
        "use_post_quant_conv": false, "mid_block_add_attention": true
    });
    let sched = json!({
        "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": false
    });
    let recipe = crate::zimage::recipe("turbo", 3.0);
    [
        ("dit.config_json", dit),
        ("te.config_json", te),
        ("vae.config_json", vae),
        ("zimage.config_json", recipe),
        ("zimage.scheduler_json", sched),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), serde_json::to_vec_pretty(&v).expect("json")))
    .collect()
}

pub fn z_image_turbo(args: &SynthArgs) -> Result<SynthSpec> {
    let tok = tokenizer::for_vocab(VOCAB, args.tokenizer)?;
    let te_layers = TE_LAYERS_SRC - 1;
    let arch = Arch {
        arch_name: "z_image".into(),
        hidden_size: CAP,
        intermediate_size: TE_FFN,
        num_layers: te_layers,
        num_attention_heads: TE_HEADS,
        num_kv_heads: TE_KV,
        head_dim: TE_HD,
        vocab_size: VOCAB,
        layer_types: vec![LayerType::FullAttention; te_layers],
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
        max_position_embeddings: 40960,
        ..Arch::default()
    };
    let mut header = Header::new(arch, QuantType::Q8_2f);
    header.tokenizer_config = Some(TokenizerConfig {
        chat_template: Some(tokenizer::CHATML_TEMPLATE.into()),
        ..Default::default()
    });
    let mut tensors = Vec::new();
    dit_tensors(&mut tensors);
    te_tensors(&mut tensors);
    vae_tensors(&mut tensors);
    Ok(SynthSpec {
        header,
        tokenizer_json: Some(tok.json),
        tensors,
        blobs: blobs(),
    })
}
