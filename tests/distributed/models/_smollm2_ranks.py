"""Rank worker of the SmolLM2-135M tests: the converted checkpoint imported by `HFBridge` at a
layout, its last-stage logits on a chat-formatted prompt, and the TP=2 refusal."""

from __future__ import annotations

import torch
from _hf_ranks import _pipeline_forward


def prompt_ids(directory: str) -> torch.Tensor:
    """``[2, S]`` ids: two questions in the model's chat template, cut to the shorter one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = []
    for question in ("What is the capital of France?", "What is 12 + 7?"):
        chat = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        rows.append(ids if torch.is_tensor(ids) else ids["input_ids"])
    width = min(row.shape[1] for row in rows)
    return torch.cat([row[:, :width] for row in rows])


@torch.no_grad()
def layout_logits(rank: int, directory: str, pp: int) -> torch.Tensor | None:
    """Logits ``[2, S, V]`` of the imported model at PP=``pp`` (DP = 2/PP) on the last stage."""
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(pipeline_model_parallel_size=pp)
    groups = megatron_groups()
    bridge = HFBridge.from_pretrained(directory)
    chunk = bridge.build_chunk(bridge.transformer_config(groups), groups=groups).eval()
    ids = prompt_ids(directory)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return _pipeline_forward([chunk], ids, position_ids=positions)


def tp2_refusal(rank: int, directory: str) -> str:
    """The error `HFBridge` gives for TP=2 (9 query heads, 3 key/value heads)."""
    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(tensor_model_parallel_size=2)
    groups = megatron_groups()
    bridge = HFBridge.from_pretrained(directory)
    try:
        bridge.build_chunk(bridge.transformer_config(groups), groups=groups)
    except ValueError as error:
        return str(error)
    return "no error"


__all__ = ["layout_logits", "prompt_ids", "tp2_refusal"]
