#!/usr/bin/env python3
"""Regenerates fixtures/zimage/: a random-weight *tiny* Z-Image pipeline saved as a diffusers tree, and
the outputs diffusers/transformers compute from it, for the Rust parity tests (crates/cmf-zimage/tests).

usage: /work/venv/bin/python scripts/make_zimage_fixtures.py [--out fixtures/zimage]

Oracle: diffusers 0.42.1 (ZImagePipeline, ZImageTransformer2DModel, AutoencoderKL,
FlowMatchEulerDiscreteScheduler) and transformers 5.x (Qwen3Model), all in f32 on the CPU.

Geometry (the `--tiny` config of shared/bench/zimage_diffusers.py): text encoder Qwen3 hidden 64,
3 layers, 4 q / 2 kv heads of 16; DiT dim 128, 2 layers, 1 noise + 1 context refiner, 4 heads,
axes_dims [8, 12, 12]; FLUX-style VAE with block_out (32, 32, 32, 32), 8 norm groups.

Tokenizer: the real Qwen3 tokenizer.json is ~11 MB, so we train a tiny byte-level BPE with the
same normalizer (NFC), pre-tokenizer (the Qwen2 split regex + byte level), decoder, special tokens
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`, appended after the merges as
in Qwen) and the Qwen3 chat template. The text encoder's vocabulary (320 rows) covers it with
unused rows at the end, as Qwen3's 151936 rows cover its 151669 tokens.

All parameters are perturbed away from their init values (norm weights 1 + N(0, 0.1²), pad tokens
N(0, 0.5²), GroupNorm biases …) so that a wrong norm weight or a missing pad token shows up.
Everything is seeded; re-running gives bit-identical files on the same torch build.
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
TE_VOCAB = 320

# The Qwen3 chat template (tokenizer_config.json of the Qwen3 releases). Z-Image applies it with
# add_generation_prompt=True, enable_thinking=True.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

CORPUS = [
    "A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph.",
    "a cat sitting on a windowsill, watercolor painting, pastel colors, morning sun",
    "An astronaut riding a horse on the moon, cinematic lighting, 35mm film, grain",
    "portrait of an old fisherman with a grey beard, dramatic shadows, oil on canvas",
    "The quick brown fox jumps over the lazy dog. 1234567890 !?.,;:'\"()[]{}",
    "Ein Fuchs im Schnee. Un renard dans la neige. 雪の中の狐。 狐狸在雪地里。",
    "city skyline at night with neon signs and rain reflections, cyberpunk style",
    "bowl of ramen with a soft boiled egg, steam rising, food photography, 50mm lens",
] * 4

PROMPTS = {
    "fox": "A red fox standing in a snowy birch forest at dawn, soft light, highly detailed photograph",
    "unicode": "Ein Fuchs im Schnee \u2014 \u72d0\u72f8 \U0001f98a, cafe\u0301 (NFC), \ttab  and  spaces\n new line",
    "empty": "",
}
NEGATIVE = "blurry, low quality, watermark"


def build_tokenizer(out_dir):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TE_VOCAB - 24, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(THINK)
    assert tok.get_vocab_size() <= TE_VOCAB
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "padding_side": "right",
        "split_special_tokens": False,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


@torch.no_grad()
def perturb(module, gen, norm_std=0.1, pad_std=0.5, bias_std=0.05):
    """Moves every parameter away from its init value (ones / zeros) so each one matters."""
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("pad_token"):
            p.copy_(noise * pad_std)
        elif p.ndim == 1 and torch.all(p == 1):
            p.copy_(1 + noise * norm_std)
        elif p.ndim == 1 and torch.all(p == 0):
            p.copy_(noise * bias_std)


def tensors_f32(d):
    return {k: v.detach().to(torch.float32).contiguous() for k, v in d.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "zimage"))
    a = ap.parse_args()
    out = os.path.abspath(a.out)
    tree = os.path.join(out, "tiny")
    exp = os.path.join(out, "expected")
    shutil.rmtree(tree, ignore_errors=True)
    shutil.rmtree(exp, ignore_errors=True)
    os.makedirs(exp)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)

    # ── build and save the diffusers tree ──
    build_tokenizer(os.path.join(tree, "tokenizer"))
    te_cfg = Qwen3Config(
        vocab_size=TE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, initializer_range=0.08,
        torch_dtype="float32",
    )
    te_lm = Qwen3ForCausalLM(te_cfg).eval()
    perturb(te_lm, gen)
    # Sharded on purpose: the converter must follow model.safetensors.index.json.
    te_lm.save_pretrained(os.path.join(tree, "text_encoder"), max_shard_size="200KB")

    dit = ZImageTransformer2DModel(
        dim=128, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=64, axes_dims=[8, 12, 12]
    ).eval()
    perturb(dit, gen)
    dit.save_pretrained(os.path.join(tree, "transformer"))

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 32, 32), norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    perturb(vae, gen)
    vae.save_pretrained(os.path.join(tree, "vae"))

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    sched.save_pretrained(os.path.join(tree, "scheduler"))
    with open(os.path.join(tree, "model_index.json"), "w") as f:
        json.dump(
            {
                "_class_name": "ZImagePipeline",
                "_diffusers_version": "0.42.1",
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "Qwen3Model"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"],
                "transformer": ["diffusers", "ZImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"],
            },
            f,
            indent=2,
        )

    # ── reload it the way a user would: the outputs below are the tree's, not the in-memory modules' ──
    pipe = ZImagePipeline.from_pretrained(tree, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    tok = pipe.tokenizer
    te = pipe.text_encoder.eval()
    dit = pipe.transformer.eval()
    vae = pipe.vae.eval()
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"

    cases = {"prompts": PROMPTS, "negative_prompt": NEGATIVE}

    # ── text encoder: token ids and hidden_states[-2] through the pipeline's own encode_prompt ──
    te_out = {}
    for key, prompt in PROMPTS.items():
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        ids = tok(text, truncation=True, max_length=512)["input_ids"]
        emb = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)[0][0]
        assert emb.shape[0] == len(ids)
        te_out[f"ids.{key}"] = torch.tensor(ids, dtype=torch.int32)
        te_out[f"hidden.{key}"] = emb.float()
        cases.setdefault("templated", {})[key] = text
    # The layer tap: hidden_states[-2] must be the raw output of decoder layer n-2 (0-based), no norm.
    taps = []
    h = te.layers[1].register_forward_hook(lambda m, i, o: taps.append(o[0] if isinstance(o, tuple) else o))
    ids = te_out["ids.fox"].long()[None]
    hs = te(input_ids=ids, output_hidden_states=True).hidden_states
    h.remove()
    assert len(hs) == te_cfg.num_hidden_layers + 1
    assert torch.equal(hs[-2][0], taps[0][0]), "hidden_states[-2] is not the output of layer n-2"
    assert torch.allclose(hs[-2][0], te_out["hidden.fox"], atol=1e-6)
    # Over the 512-token limit: diffusers truncates the *templated* ids (the template's tail is lost).
    long_prompt = " ".join(["snowy birch forest fox"] * 200)
    text = tok.apply_chat_template(
        [{"role": "user", "content": long_prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    full = tok(text)["input_ids"]
    assert len(full) > 512
    te_out["ids.long"] = torch.tensor(tok(text, truncation=True, max_length=512)["input_ids"], dtype=torch.int32)
    cases["long_prompt"] = long_prompt
    cases["long_prompt_full_tokens"] = len(full)
    save_file(te_out, os.path.join(exp, "te.safetensors"))

    # ── DiT: single forwards, incl. padding of the caption and the image sequence, and a masked batch ──
    g = torch.Generator().manual_seed(7)
    dit_out = {}
    dit_cases = {
        # (latent h, latent w, caption rows, t): 3x5 = 15 image tokens -> 32, 7 caption rows -> 32
        "pad": [(6, 10, 7, 0.37)],
        # 4x8 = 32 image tokens, 32 caption rows: no padding at all
        "exact": [(8, 16, 32, 0.9)],
        # a batch of two (CFG-like): captions of 5 and 40 rows (-> 32 and 64), attention masks in play
        "batch2": [(4, 4, 5, 0.5), (4, 4, 40, 0.5)],
    }
    for name, items in dit_cases.items():
        xs, caps, ts = [], [], []
        for i, (lh, lw, nc, t) in enumerate(items):
            x = torch.randn(16, 1, lh, lw, generator=g)
            c = torch.randn(nc, 64, generator=g)
            xs.append(x)
            caps.append(c)
            ts.append(t)
            dit_out[f"{name}.{i}.x"] = x[:, 0]
            dit_out[f"{name}.{i}.cap"] = c
            dit_out[f"{name}.{i}.t"] = torch.tensor([t], dtype=torch.float32)
        with torch.no_grad():
            outs = dit(xs, torch.tensor(ts, dtype=torch.float32), caps, return_dict=False)[0]
        for i, o in enumerate(outs):
            dit_out[f"{name}.{i}.out"] = o[:, 0].float().contiguous()
    save_file(dit_out, os.path.join(exp, "dit.safetensors"))

    # ── scheduler: σ and timesteps as the pipeline computes them ──
    sched_out = {}
    for shift in (3.0, 6.0):
        s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)
        for n in (1, 2, 3, 4, 8, 9, 20, 28, 50):
            sig = torch.linspace(1.0, 1 / n, n).tolist()  # get_default_z_image_sigmas
            s.set_timesteps(sigmas=sig, device="cpu", mu=None)
            ts = s.timesteps
            key = f"s{shift:g}.n{n}"
            sched_out[f"sigmas.{key}"] = s.sigmas.float().contiguous()
            sched_out[f"timesteps.{key}"] = ts.float().contiguous()
            sched_out[f"tmodel.{key}"] = ((1000 - ts) / 1000).float().contiguous()
    save_file(sched_out, os.path.join(exp, "scheduler.safetensors"))

    # ── VAE decode of given latents (already unscaled: what the decoder receives) ──
    g = torch.Generator().manual_seed(11)
    vae_out = {}
    for name, (lh, lw) in {"square": (8, 8), "wide": (6, 10)}.items():
        z = torch.randn(1, 16, lh, lw, generator=g)
        with torch.no_grad():
            img = vae.decode(z, return_dict=False)[0]
        vae_out[f"{name}.z"] = z[0]
        vae_out[f"{name}.image"] = img[0].float().contiguous()
    save_file(vae_out, os.path.join(exp, "vae.safetensors"))

    # ── whole pipeline with injected latents ──
    g = torch.Generator().manual_seed(21)
    pipe_out = {}
    recipes = {
        "turbo": dict(prompt=PROMPTS["fox"], height=48, width=80, num_inference_steps=8, guidance_scale=0.0),
        "cfg": dict(
            prompt=PROMPTS["fox"], negative_prompt=NEGATIVE, height=64, width=64, num_inference_steps=5,
            guidance_scale=4.0,
        ),
    }
    for name, r in recipes.items():
        lat = torch.randn(1, 16, r["height"] // 8, r["width"] // 8, generator=g)
        final = {}

        def keep(pipe_, i, t, kw):
            final["latents"] = kw["latents"].clone()
            return kw

        img = pipe(**r, latents=lat.clone(), output_type="np", callback_on_step_end=keep).images[0]
        pipe_out[f"{name}.latents"] = lat[0]
        pipe_out[f"{name}.final_latents"] = final["latents"][0].float().contiguous()
        # diffusers' numpy_to_pil: (x * 255).round().astype(uint8), x already clamped to [0, 1]
        pipe_out[f"{name}.image"] = torch.from_numpy(np.ascontiguousarray((img * 255).round().astype(np.uint8)))
        cases.setdefault("recipes", {})[name] = r
    save_file(pipe_out, os.path.join(exp, "pipeline.safetensors"))

    with open(os.path.join(exp, "cases.json"), "w") as f:
        json.dump(cases, f, indent=2, ensure_ascii=False)
    total = sum(os.path.getsize(os.path.join(d, x)) for d, _, fs in os.walk(out) for x in fs)
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
