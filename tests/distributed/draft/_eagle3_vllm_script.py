"""Run by ``test_eagle3_vllm.py`` in a process of its own (vLLM's engine starts processes): for each
exported EAGLE-3 draft, the target layers both of vLLM's model runners read from its config
(V1 ``GPUModelRunner._get_eagle3_aux_layers_from_config``, V2
``eagle3_utils.get_eagle3_aux_layers_from_config``; the V2 one is the only one from vLLM 0.34 on),
the layers the engine's target captures, and greedy generation from the tiny Llama target by vLLM
with the draft (``speculative_config={"method": "eagle3", ...}``); the target's greedy tokens by
transformers alone. Prints one JSON line."""

from __future__ import annotations

import gc
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# apply_model ships a function to the engine process (cloudpickle)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [[1, 5, 6, 7, 8], [3, 9, 10], [2, 4, 4, 4, 4, 4]]
NEW = 10


def config_layer_ids(draft: str) -> dict[str, Any]:
    """The aux layer ids vLLM's V1 and V2 model runners read from the draft's ``config.json``
    (``None``: none found, the runner then captures the target's defaults)."""
    import transformers
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf_config = transformers.AutoConfig.from_pretrained(draft)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(
        SimpleNamespace(speculative_config=spec)  # type: ignore[arg-type]
    )
    v2 = get_eagle3_aux_layers_from_config(spec)  # type: ignore[arg-type]
    return {"v1": None if v1 is None else list(v1), "v2": None if v2 is None else list(v2)}


def captured_layers(model: Any) -> list[int]:
    """The vLLM ids of the target layers whose hidden states the engine hands the draft."""
    return list(model.model.aux_hidden_state_layers)


def speculative(target: str, draft: str) -> dict[str, Any]:
    """vLLM with the EAGLE-3 draft proposing 2 tokens per step: the captured target layers and
    the greedy tokens. The engine is shut down before the next one starts."""
    import vllm

    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 2}
    llm = vllm.LLM(model=target, dtype="float32", max_model_len=64, enforce_eager=True,
                   seed=0, speculative_config=spec)  # fmt: skip
    # by reference to this module (not ``__main__``), which the engine's processes import too
    import _eagle3_vllm_script as this

    captured = llm.apply_model(this.captured_layers)[0]
    params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"captured": captured, "tokens": tokens}


def plain(target: str) -> list[list[int]]:
    """The target's own greedy tokens (transformers, fp32), up to and with its EOS as vLLM's."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        out.append(generated[0, len(prompt) :].tolist())
    return out


if __name__ == "__main__":
    target, drafts = sys.argv[1], sys.argv[2:]
    result: dict[str, Any] = {"drafts": {}}
    for draft in drafts:
        result["drafts"][draft] = {"config": config_layer_ids(draft), **speculative(target, draft)}
    result["plain"] = plain(target)
    print(json.dumps(result))
