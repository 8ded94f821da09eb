"""Rank functions of the vLLM rollout-source tests (``test_vllm_rollout.py``): a
:class:`VLLMRolloutSource` over two gloo ranks against ``transformers`` fp32 forwards of the
weights it was loaded or refit with."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_rl.rollout import SamplingConfig, VLLMRolloutSource

# Left-padded prompts (pad 0): rows 0 and 3 are the same prompt, so only their seeds differ.
PROMPTS = torch.tensor([[0, 0, 5, 9, 17], [3, 14, 15, 92, 65], [0, 0, 0, 35, 89], [0, 0, 5, 9, 17]])
LENGTHS = torch.tensor([3, 5, 2, 3])
STOP = 7
SAMPLING = SamplingConfig(max_new_tokens=8, temperature=0.7, seed=11, stop_token_ids=(STOP,))
REFITS = 3


@torch.no_grad()
def reference_logprobs(model: Any, rollout: Any, temperature: float) -> torch.Tensor:
    """``[B, P+N]`` each completion token's ``log_softmax(logits / T)`` from a ``transformers``
    forward of the row's real tokens alone (0 elsewhere)."""
    out = torch.zeros_like(rollout.generation_logprobs)
    width = rollout.prompt_width
    for i, length in enumerate(rollout.prompt_lengths.tolist()):
        real = rollout.tokens[i, width - length :][: length + int(rollout.completion_mask[i].sum())]
        logp = (model(input_ids=real[None]).logits[0].float() / temperature).log_softmax(-1)
        picked = logp[:-1].gather(1, real[1:, None])[:, 0]  # token t+1 scored at t
        out[i, width : width + len(real) - length] = picked[length - 1 :]
    return out


def _perturb(model: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _error(model: Any, rollout: Any) -> float:
    ref = reference_logprobs(model, rollout, SAMPLING.temperature)
    mask = rollout.completion_mask.bool()
    return float((rollout.generation_logprobs - ref)[mask].abs().max())


def source_rank(rank: int, hf_dir: str) -> dict[str, Any]:
    """Load, sample, then 3 x (perturb the weights; sample stale; refit; sample)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    started = time.perf_counter()
    source = VLLMRolloutSource(Path(hf_dir), dist.group.WORLD)
    result: dict[str, Any] = {"generator": source.is_generator, "start_s": 0.0}
    result["start_s"] = time.perf_counter() - started
    rollout = source.generate(PROMPTS, SAMPLING, LENGTHS)
    result.update(initial=rollout, initial_error=_error(model, rollout), stale=[], refit=[])
    result["refit_s"] = []
    for step in range(REFITS):
        _perturb(model, seed=100 + step)  # the same update on every rank
        result["stale"].append(_error(model, source.generate(PROMPTS, SAMPLING, LENGTHS)))
        started = time.perf_counter()
        source.update_weights(iter(model.state_dict().items()))
        result["refit_s"].append(time.perf_counter() - started)
        refit = source.generate(PROMPTS, SAMPLING, LENGTHS)
        result["refit"].append((_error(model, refit), refit))
    return result
