"""Run by ``test_eagle3_vllm.py`` in a process of its own (vLLM's engine starts processes): greedy
generation from the tiny Llama target by vLLM with the exported EAGLE-3 draft
(``speculative_config={"method": "eagle3", ...}``) and by transformers alone; prints one JSON
line."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPTS = [[1, 5, 6, 7, 8], [3, 9, 10], [2, 4, 4, 4, 4, 4]]
NEW = 10


def speculative(target: str, draft: str) -> list[list[int]]:
    """vLLM greedy tokens with the EAGLE-3 draft proposing 2 tokens per step."""
    import vllm

    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 2}
    llm = vllm.LLM(model=target, dtype="float32", max_model_len=64, enforce_eager=True,
                   seed=0, speculative_config=spec)  # fmt: skip
    params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def plain(target: str) -> list[list[int]]:
    """The target's own greedy tokens (transformers, fp32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
        out.append(generated[0, len(prompt) :].tolist())
    return out


if __name__ == "__main__":
    target, draft = sys.argv[1], sys.argv[2]
    print(json.dumps({"eagle3": speculative(target, draft), "plain": plain(target)}))
