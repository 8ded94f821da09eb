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

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))  # the tiny MoE set-up
from _routing_ranks import (  # noqa: E402
    NEW,
    PROMPT,
    ROWS,
    dense_record_error_rank,
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


def test_record_routing_of_a_dense_model_raises() -> None:
    message = run_on_ranks(dense_record_error_rank, 1)[0]
    assert (
        message
        == "ValueError: `record_routing=True` needs a model with MoE layers; this one has none"
    )
