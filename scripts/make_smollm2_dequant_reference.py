"""Reference logits of the SmolLM2 demo model with its weights dequantized exactly (f32), by
transformers (which dequantizes GGUF files itself): what an exact engine must compute.

For each prompt of fixtures/llamacpp/greedy.json, the logits at the last prompt position:
the 20 largest (id, value) and the values at llama.cpp's top-5 ids. cmf-llm's
`llamacpp_parity.rs` checks `cmf import-gguf --quant f32` against them.

usage: python scripts/make_smollm2_dequant_reference.py GGUF_DIR
       (GGUF_DIR holds SmolLM2-135M-Instruct.Q4_1.gguf; scripts/fetch-demo-model.sh fetches it)
writes crates/cmf-llm/tests/data/smollm2_dequant_logits.json
"""
import json, os, sys
import torch, transformers
from transformers import AutoModelForCausalLM

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                             dtype=torch.float32).eval()
ref = json.load(open(os.path.join(root, "fixtures/llamacpp/greedy.json")))
out = {"generated_by": {"script": "scripts/make_smollm2_dequant_reference.py", "torch": torch.__version__,
                        "transformers": transformers.__version__},
       "model": "SmolLM2-135M-Instruct.Q4_1.gguf, every tensor dequantized to f32 by transformers' GGUF loader",
       "prompts": []}
for p in ref["prompts"]:
    with torch.no_grad():
        logits = model(torch.tensor([p["prompt_ids"]])).logits[0, -1]
    top = torch.topk(logits, 20)
    llama_top5 = [i for i, _ in p["steps"][0]["top5"]]
    out["prompts"].append({"name": p["name"], "prompt_ids": p["prompt_ids"],
                           "top20": [[int(i), round(float(v), 5)] for v, i in zip(top.values, top.indices)],
                           "at_llamacpp_top5": [[i, round(float(logits[i]), 5)] for i in llama_top5]})
path = os.path.join(root, "crates/cmf-llm/tests/data/smollm2_dequant_logits.json")
json.dump(out, open(path, "w"), indent=1)
print("wrote", path)
