"""Multi-token prediction through the training step: megatron's MTP layers on the tiny GPT
(``mtp_num_layers=2``), trained without labels next to an RL loss.

* The ``mtp_<d>_loss`` metrics equal a plain-torch reference (prompt and masked samples excluded,
  normalised by the policy loss's global valid token count) within 1e-5 (fp32: a sum of ~30
  cross entropies of ~5 each, divided by N_t, so rounding is ~1e-6), and ``mtp_loss`` is their
  mean.
* The gradients of the MTP parameters equal the reference's autograd of
  ``mtp_loss_scaling_factor / D * sum_d L_d`` within 1e-5 (the term reaches megatron's backward
  through ``MTPLossAutoScaler``; the policy loss does not touch those parameters).
* Two microbatches, sequence packing and TP=2 (real gloo ranks) give the same metrics and every
  gradient within 1e-5.
* PP=2 (rope positions, packed) equals the single-rank rope step the same way; learned position
  embeddings under PP are refused (megatron 0.16 keeps the MTP stage's copy out of sync).
* Sampling (KV cache or full prefix) runs the main head only: the same log-probabilities as the
  tiny GPT without MTP layers, bitwise.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _mtp_ranks import DEPTHS, MTPStep, single_rank_run, tensor_parallel_run

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5


@functools.cache
def _single() -> dict:
    return run_on_ranks(single_rank_run, 1, timeout=180)[0]


@functools.cache
def _tp2() -> list[dict]:
    return run_on_ranks(tensor_parallel_run, 2, timeout=180)


def _max_grad_diff(actual: dict, expected: dict, keys: list[str] | None = None) -> float:
    keys = sorted(expected) if keys is None else keys
    return max(float((actual[k] - expected[k]).abs().max()) for k in keys)


def _assert_same_step(step: MTPStep, reference: MTPStep) -> None:
    assert sorted(step.metrics) == sorted(reference.metrics)
    for key, value in reference.metrics.items():
        assert step.metrics[key] == pytest.approx(value, abs=ATOL), key
    assert step.loss == pytest.approx(reference.loss, abs=ATOL)
    assert sorted(step.grads) == sorted(reference.grads)
    assert _max_grad_diff(step.grads, reference.grads) <= ATOL


def test_mtp_loss_equals_the_plain_torch_reference_with_the_prompt_masked() -> None:
    single = _single()
    reference, step = single["reference"], single["padded_M1"]
    terms = [step.metrics[f"mtp_{d + 1}_loss"] for d in range(DEPTHS)]
    assert terms == pytest.approx(reference.terms, abs=ATOL)
    assert step.metrics["mtp_loss"] == pytest.approx(sum(reference.terms) / DEPTHS, abs=ATOL)
    assert min(reference.terms) > 1.0  # ~ln(128) per token: a real loss, not an empty mask


def test_mtp_gradients_equal_the_reference_autograd() -> None:
    single = _single()
    reference, step = single["reference"], single["padded_M1"]
    assert reference.grads  # the MTP parameters: enorm, hnorm, eh_proj, layer, final norm
    assert _max_grad_diff(step.grads, reference.grads) <= ATOL
    assert max(float(g.abs().max()) for g in reference.grads.values()) > 1e-4


@pytest.mark.parametrize("name", ["padded_M2", "packed_M2"])
def test_microbatching_and_packing_do_not_change_mtp(name: str) -> None:
    single = _single()
    _assert_same_step(single[name], single["padded_M1"])


@pytest.mark.parametrize("name", ["padded_M2", "packed_M2"])
def test_tensor_parallel_equals_single_rank(name: str) -> None:
    reference = _single()["padded_M1"]
    for rank_result in _tp2():
        _assert_same_step(rank_result[name], reference)


def test_pipeline_parallel_equals_single_rank_with_rope() -> None:
    reference = _single()["rope_M1"]
    steps = [rank_result["pp2_rope_M2"] for rank_result in _tp2()]
    grads: dict = {}
    for step in steps:  # each stage's parameters; the tied word embedding is on both
        grads.update(step.grads)
    merged = MTPStep(steps[1].metrics, steps[1].loss, grads)
    _assert_same_step(merged, reference)
    assert steps[0].metrics == steps[1].metrics


def test_pipeline_parallel_with_learned_positions_is_refused() -> None:
    for rank_result in _tp2():
        message = rank_result["pp2_learned_error"]
        assert "needs `position_embedding_type='rope'`" in message and "PP=2" in message


@pytest.mark.parametrize("kv_cache", [True, False])
def test_decoding_runs_the_main_head_only(kv_cache: bool) -> None:
    decoding = _single()["decoding"]
    mtp, plain = decoding[f"mtp_kv={kv_cache}"], decoding[f"plain_kv={kv_cache}"]
    assert bool((mtp != 0).any())
    assert torch.equal(mtp, plain)
