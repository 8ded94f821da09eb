"""Online EAGLE draft training in the policy's step (``StepContext(draft_model=...)``): a 4-layer tiny
GPT trained with ClippedPG, the draft reading its decoder layers 2 and 3.

* The draft loss, top-1 agreement and expected acceptance equal a plain-torch reference on the same captured hidden
  states within 1e-5, and so do the draft's gradients (fp32; the loss is a mean of ~30 soft
  cross entropies of ~4).
* The policy's loss, metrics and every gradient (so its grad norm) are bitwise those of the step
  without a draft: the draft reads detached activations and a detached teacher.
* Two microbatches, sequence packing, TP=2 (also with sequence parallelism: the captured layer
  outputs are gathered over TP) and PP=2 (real gloo ranks) give the one-microbatch
  TP=1 draft loss and draft gradients (so draft grad norm) within 1e-5.
* ``defer_draft_normalization=True`` gives the same metrics and the same SGD-updated draft weights
  as ``False`` within 1e-6.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _draft_ranks import LR, DraftStep, single_rank_run, two_rank_run

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
DRAFT_METRICS = ("draft_loss", "draft_top1_agreement", "draft_expected_acceptance")


@functools.cache
def _single() -> dict:
    return run_on_ranks(single_rank_run, 1, timeout=180)[0]


@functools.cache
def _two() -> list[dict]:
    return run_on_ranks(two_rank_run, 2, timeout=180)


def _max_diff(actual: dict, expected: dict) -> float:
    assert sorted(actual) == sorted(expected)
    return max(float((actual[k] - expected[k]).abs().max()) for k in expected)


def _norm(grads: dict) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def _merged(name: str) -> DraftStep:
    """Both ranks' step: policy grads of every stage, the draft's from the rank holding it."""
    steps = [r[name] for r in _two()]
    policy: dict = {}
    for step in steps:
        policy.update(step.policy_grads)
    holder = next((s for s in steps if s.draft_grads), steps[0])
    return DraftStep(steps[0].loss, steps[0].metrics, policy, holder.draft_grads,
                     holder.draft_updated)  # fmt: skip


def test_draft_loss_and_grads_equal_the_plain_torch_reference() -> None:
    reference, step = _single()["reference"], _single()["on"]
    print("draft", step.metrics["draft_loss"], reference.loss, "agreement",
          step.metrics["draft_top1_agreement"], reference.agreement)  # fmt: skip
    assert step.metrics["draft_loss"] == pytest.approx(reference.loss, abs=ATOL)
    assert step.metrics["draft_top1_agreement"] == pytest.approx(reference.agreement, abs=ATOL)
    acceptance = step.metrics["draft_expected_acceptance"]
    assert acceptance == pytest.approx(reference.acceptance, abs=ATOL)
    assert 0.0 < acceptance < 1.0
    assert reference.loss > 1.0  # ~ln(64) against a near-uniform teacher: not an empty mask
    assert _max_diff(step.draft_grads, reference.grads) <= ATOL
    assert _norm(reference.grads) > 1e-3


@pytest.mark.parametrize(("on", "off"), [("on", "off"), ("packed_M2", "packed_off")])
def test_the_policy_is_bitwise_unchanged_by_draft_training(on: str, off: str) -> None:
    with_draft, without = _single()[on], _single()[off]
    assert with_draft.loss == without.loss
    assert {k: v for k, v in with_draft.metrics.items() if k not in DRAFT_METRICS} == (
        without.metrics
    )
    assert sorted(with_draft.policy_grads) == sorted(without.policy_grads)
    for key, grad in without.policy_grads.items():
        assert torch.equal(with_draft.policy_grads[key], grad), key
    assert _norm(with_draft.policy_grads) == _norm(without.policy_grads)


def test_pipeline_policy_is_bitwise_unchanged_by_draft_training() -> None:
    with_draft, without = _merged("pp2"), _merged("pp2_off")
    assert with_draft.loss == without.loss
    for key, grad in without.policy_grads.items():
        assert torch.equal(with_draft.policy_grads[key], grad), key


def _assert_same_draft(step: DraftStep, reference: DraftStep) -> None:
    for key in DRAFT_METRICS:
        assert step.metrics[key] == pytest.approx(reference.metrics[key], abs=ATOL), key
    assert _max_diff(step.draft_grads, reference.draft_grads) <= ATOL
    assert _norm(step.draft_grads) == pytest.approx(_norm(reference.draft_grads), abs=ATOL)


@pytest.mark.parametrize("name", ["on_M2", "packed_M2"])
def test_microbatching_and_packing_do_not_change_the_draft(name: str) -> None:
    _assert_same_draft(_single()[name], _single()["on"])


@pytest.mark.parametrize("name", ["tp2", "tp2_packed", "tp2_sp", "tp2_sp_packed", "pp2"])
def test_tensor_and_pipeline_parallel_equal_single_rank(name: str) -> None:
    _assert_same_draft(_merged(name), _single()["on"])


def test_deferred_normalisation_gives_the_same_update() -> None:
    deferred, direct = _single()["deferred_M2"], _single()["on_M2"]
    for key in DRAFT_METRICS:
        assert deferred.metrics[key] == pytest.approx(direct.metrics[key], abs=1e-6), key
    # SGD (lr = LR): the update carries the gradient's scale, which Adam would normalise away
    assert _max_diff(deferred.draft_updated, direct.draft_updated) <= 1e-6
    assert _max_diff(deferred.draft_grads, direct.draft_grads) <= 1e-6 / LR
