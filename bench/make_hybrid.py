"""A random-weight Qwen3-Next hybrid for CPU benchmarks of the batched engine: 8 layers (three
GatedDeltaNet mixers per gated-attention layer), hidden 512, dense SiLU MLPs, a 4,096-position
context, and the 512-entry tokenizer and chat template of `fixtures/llm/qwen3next-tiny`. Needs
torch and transformers. Writes a Hugging Face directory for `cmf convert --model`.

usage: python3 bench/make_hybrid.py OUT_DIR
"""
import shutil, sys
from pathlib import Path
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

out = Path(sys.argv[1])
fixture = Path(__file__).resolve().parent.parent / "fixtures/llm/qwen3next-tiny"
torch.manual_seed(0)
cfg = Qwen3NextConfig(
    vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4,
    mlp_only_layers=list(range(8)), max_position_embeddings=4096,
    partial_rotary_factor=0.25, tie_word_embeddings=False, eos_token_id=2,
)
model = Qwen3NextForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(fixture / name, out / name)
print(out)
