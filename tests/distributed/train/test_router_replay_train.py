"""MoE routing masks and router replay through the package's step (tiny MoE GPT, fp32, gloo).

Masks: megatron's routers get ``padding_mask`` (True = padding) in their own token order, so
padded and packed passes route the real tokens exactly as each row alone (same per-expert counts,
logprobs within fp32 kernel noise) and every padding token is marked (padding keeps out of the
aux loss / expert-bias counts; megatron still computes its experts' outputs).

Replay: the rollout's routing is recorded at W0; after one optimizer step (W1) the routers pick
other experts for part of the (token, layer) slots, so a trainer routing on its own disagrees
with the engine (which kept the W0 routing) and ``token_mult_prob_error`` exceeds 1; replaying
``routed_experts`` makes every real token's routing map the recorded one and the error 1 +- 1e-6,
padded or packed, at EP=1 and EP=2 (which agree).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _router_replay_ranks import LENGTHS, MOE, S, masks_rank, replay_rank

from lightning_mcore_rl.testing import run_on_ranks

# fp32: packed THD and padded local attention, per-row and batched GEMMs sum in different
# orders; measured <= 9.5e-7 on these logprobs (|lp| ~ 5: 2 ulp of fp32), so 2e-6 (4 ulp) while
# a trainer routing on its own is off by up to 0.997 (token_mult_prob_error 1.2776 vs 1 + 2.4e-7
# with replay; 63 of 74 real (token, layer) slots re-routed after the step at EP=1).
ATOL = 2e-6


@functools.cache
def _masks() -> dict:
    return run_on_ranks(masks_rank, 1, timeout=120)[0]


@functools.cache
def _replay(ep: int) -> list[dict]:
    return run_on_ranks(replay_rank, 2 if ep == 2 else 1, ep, timeout=120)


def test_padded_and_packed_route_real_tokens_as_each_row_alone() -> None:
    out = _masks()
    pads = {"padded": len(LENGTHS) * S - sum(LENGTHS)}  # right padding of the [4, 12] rows
    pads["packed"] = 0  # no per-span padding at TP=CP=1: the packed row holds real tokens only
    for layout in ("padded", "packed"):
        got = out[layout]
        assert got["masked"], layout  # every router call got megatron's padding mask
        assert got["pad"] == 2 * pads[layout], layout  # x 2 MoE layers
        assert torch.equal(got["real"], out["alone_counts"]), layout
        for i, length in enumerate(LENGTHS):
            torch.testing.assert_close(got["lp"][i, :length], out["alone_lp"][i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("ep", [1, 2])
def test_replay_routes_as_recorded_and_closes_the_mismatch(ep: int) -> None:
    runs = _replay(ep)
    k = MOE["moe_router_topk"]
    mismatch = sum(r["mismatched_slots"] for r in runs) / sum(k * r["real_slots"] for r in runs)
    for rank, out in enumerate(runs):
        # the W0 -> W1 step changed the routing of part of the real (token, layer) slots
        assert out["changed_slots"] > 0.1 * out["real_slots"], (rank, out["changed_slots"])
        for calls in (out["train_calls"], out["replay_padded"]["calls"]):
            assert calls["wrong"] == 0 and calls["total"] == out["real_slots"], (rank, calls)
        assert out["own_padded"]["calls"]["wrong"] > 0
        for layout in ("padded", "packed"):
            replayed, own = out[f"replay_{layout}"], out[f"own_{layout}"]
            assert replayed["tmpe"] == pytest.approx(1.0, abs=1e-6), (rank, layout)
            assert own["tmpe"] > 1.0 + 1e-4, (rank, layout, own["tmpe"])
            # moe/router_mismatch_fraction: 0 replayed; unreplayed, the slots counted here from
            # each row routed alone at W1 (integer counts; the metric is logged as float32)
            assert replayed["router_mismatch"] == 0.0, (rank, layout)
            assert own["router_mismatch"] == pytest.approx(mismatch, rel=1e-7)
            assert own["router_mismatch"] > 0.05, (rank, layout)
            mask = replayed["mask"].bool()
            torch.testing.assert_close(
                replayed["lp"][mask], replayed["gen"][mask], atol=ATOL, rtol=0
            )


def test_ep2_replay_equals_ep1() -> None:
    one = _replay(1)[0]
    two = _replay(2)
    for layout in ("replay_padded", "replay_packed"):
        lp = torch.cat([r[layout]["lp"] for r in two])  # DP ranks hold rows [0, 2) and [2, 4)
        torch.testing.assert_close(lp, one[layout]["lp"], atol=ATOL, rtol=0)
        for r in two:
            assert r[layout]["tmpe"] == pytest.approx(one[layout]["tmpe"], abs=1e-6)
