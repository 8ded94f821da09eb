"""The central property: the global loss and every gradient do not depend on the split.

The tiny GPT runs through Megatron's real schedule (``get_forward_backward_func``) with the
project's ``LossPostProcessor`` on gloo CPU ranks. The global loss (sum over microbatches and DP
of each microbatch's ``loss`` metric) and the TP-gathered parameter gradients of every layout
equal the single-rank, single-microbatch reference within 1e-5 (fp32), for a token-level loss
(ClippedPG with a reference KL) and a sequence-level loss (DPO with an SFT term). The reference
itself equals an independent plain-torch computation (log_softmax + gather + the PPO formula).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _train_step_ranks import LENGTHS, S, StepResult, single_rank_run, two_rank_run

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5


@functools.cache
def _single() -> dict:
    return run_on_ranks(single_rank_run, 1, timeout=120)[0]


@functools.cache
def _two() -> list[dict]:
    return run_on_ranks(two_rank_run, 2, timeout=120)


def _merged(name: str) -> StepResult:
    """Loss from the reporting rank, grads of all stages (PP) merged."""
    results: list[StepResult] = [r[name] for r in _two()]
    loss = next(r.loss for r in results if r.loss is not None)
    grads: dict = {}
    for r in results:
        grads.update(r.grads)
    return StepResult(loss, grads, results[0].num_microbatches)


def _max_grad_diff(actual: dict, expected: dict) -> float:
    assert sorted(actual) == sorted(expected)
    return max(float((actual[k] - expected[k]).abs().max()) for k in expected)


def _assert_same(result: StepResult, reference: StepResult) -> None:
    assert result.loss == pytest.approx(reference.loss, abs=ATOL)
    assert _max_grad_diff(result.grads, reference.grads) <= ATOL


@pytest.mark.parametrize("name", ["pg_M2", "pg_M4", "pg_packed_M2", "pg_packed_fused_M2"])
def test_single_rank_microbatching_and_packing_match_reference_pg(name: str) -> None:
    single = _single()
    _assert_same(single[name], single["pg_M1"])


@pytest.mark.parametrize("name", ["dpo_M2", "dpo_packed_fused_M2"])
def test_single_rank_microbatching_and_packing_match_reference_dpo(name: str) -> None:
    single = _single()
    _assert_same(single[name], single["dpo_M1"])


def test_microbatch_counts_are_what_the_layout_claims() -> None:
    single = _single()
    assert [single[k].num_microbatches for k in ("pg_M1", "pg_M2", "pg_M4")] == [1, 2, 4]


def test_reference_equals_plain_torch_loss_and_gradients() -> None:
    single = _single()
    hand, ref = single["hand"], single["pg_M1"]
    assert ref.loss == pytest.approx(hand.loss, abs=ATOL)
    assert _max_grad_diff(ref.grads, hand.grads) <= ATOL
    assert any(float(g.abs().max()) > 1e-3 for g in hand.grads.values()), "vacuous gradients"


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("tp2_pg_M2", "pg_M1"),
        ("tp2_pg_packed_M2", "pg_M1"),
        ("tp2_dpo_M2", "dpo_M1"),
        ("pp2_pg_M4", "pg_M1"),
        ("pp2_dpo_M2", "dpo_M1"),
        ("dp2_pg_M1", "pg_M1"),
        ("dp2_pg_M2", "pg_M1"),
        ("dp2_pg_packed_M1", "pg_M1"),
        ("dp2_dpo_M1", "dpo_M1"),
    ],
)
def test_parallel_layouts_match_single_rank_reference(name: str, reference: str) -> None:
    _assert_same(_merged(name), _single()[reference])


def _valid() -> torch.Tensor:
    return torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]  # [B, S]


@pytest.mark.parametrize("packed", [False, True])
def test_logprobs_post_processor_matches_plain_torch(packed: bool) -> None:
    # [B, S] with a 0 column prepended, temperature 0.7 applied in the forward step; padding
    # positions hold unmasked values, so compare where tokens are real.
    expected = _single()["hand"].logprobs_t07
    for outputs in (_single()["forward_only"], _two()[0]["tp2_forward_only"]):
        lp = outputs[f"logprobs_packed={packed}"]
        assert lp.shape == expected.shape
        assert torch.all(lp[:, 0] == 0)
        assert float(((lp - expected).abs() * _valid()).max()) <= ATOL


@pytest.mark.parametrize("packed", [False, True])
def test_topk_post_processor_is_exact(packed: bool) -> None:
    hand = _single()["hand"]
    valid = _valid()[..., None]
    single = _single()["forward_only"]
    if not packed:  # same logits bit for bit as the plain model: the top-k must be exact
        assert torch.equal(single["topk_logits_packed=False"], hand.topk_logits)
    for outputs in (single, _two()[0]["tp2_forward_only"]):
        indices = outputs[f"topk_indices_packed={packed}"]
        assert torch.equal(indices * valid, hand.topk_indices * valid)
        diff = (outputs[f"topk_logits_packed={packed}"] - hand.topk_logits).abs() * valid
        assert float(diff.max()) <= ATOL
