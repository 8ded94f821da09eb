"""The embedded sampler's ``record_routing``: every position's experts per MoE layer
(``routed_experts [B, P+N, L, K]``), the same with and without the KV cache, the sampled tokens
and logprobs unchanged, and the train step (no replay) routes those sequences exactly as
recorded (``moe/router_mismatch_fraction`` 0, padded and packed), at EP=1 and EP=2.

So a rollout's recording is what router replay needs: the key's layout is the step's (a layout
error would show as a mismatch of ~0.5 or more: measured 0.47 after one weight update)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))  # the tiny MoE set-up
from _routing_ranks import (  # noqa: E402
    NEW,
    PROMPT,
    ROWS,
    capacity_record_error_rank,
    dense_record_error_rank,
    hf_source_routing_rank,
    sampler_routing_rank,
)

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402


@pytest.mark.parametrize(("ep", "world"), [(1, 1), (2, 2)])
def test_sampler_records_the_routing_the_train_step_makes(ep: int, world: int) -> None:
    for packing in (False, True):
        for result in run_on_ranks(sampler_routing_rank, world, ep, packing, timeout=120):
            assert result["shape"] == (ROWS, PROMPT + NEW, 2, 2)  # 2 MoE layers, top-2
            assert result["same_samples"]  # recording changes no token and no logprob
            assert result["cached_tokens_equal"] and result["cached_equal"]
            experts = result["experts"]
            assert bool((experts[..., 0] < experts[..., 1]).all())  # K distinct, ascending
            assert result["mismatch"] == 0.0, (ep, packing)


def test_record_routing_refuses_what_it_cannot_record() -> None:
    capacity = run_on_ranks(capacity_record_error_rank, 1)[0]
    assert capacity.startswith("ValueError: `record_routing=True` records top-k experts per token")
    message = run_on_ranks(dense_record_error_rank, 1)[0]
    assert (
        message
        == "ValueError: `record_routing=True` needs a model with MoE layers; this one has none"
    )


def test_hf_source_records_the_routing_megatron_makes(tmp_path) -> None:
    """The HF backend's ``routed_experts`` (top-k of transformers' router logits, left-padded
    prompts) equal megatron's routing of the same checkpoint imported with HFBridge, at every
    real position of every row (each row alone in megatron: no padding involved)."""
    from lightning_mcore_rl.recipes import train_tokenizer, write_tiny_qwen3_moe

    tokenizer = train_tokenizer([" ".join(str(i) for i in range(16))])
    write_tiny_qwen3_moe(tmp_path, tokenizer, seed=1, random_pad_embedding=True)
    out = run_on_ranks(hf_source_routing_rank, 1, str(tmp_path), timeout=120)[0]
    assert out["hf"].shape == (3, 9, 2, 2)  # [B, P+N, L, K]
    for row, (start, megatron) in enumerate(zip(out["starts"], out["megatron"], strict=True)):
        assert torch.equal(out["hf"][row, start:], megatron), row
