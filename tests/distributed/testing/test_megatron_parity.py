"""megatron-core's real schedules, DDP and optimizer on gloo CPU ranks match a single-rank run.

Every layout trains the same tiny GPT (layout-invariant weights, see ``tiny_gpt``) on the same global
batch; the reference is one rank with TP=PP=DP=1 running the same schedule code path. fp32
throughout: 1e-5 absolute tolerance covers the different reduction orders of sharded matmuls.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from _layouts import LayoutRun, assert_same_tensors, merge, train_layout
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5


@functools.cache
def _reference(num_layers: int, num_microbatches: int, steps: int) -> LayoutRun:
    spec = RunSpec(num_layers=num_layers, steps=steps)
    return merge(run_on_ranks(train_layout, 1, spec, num_microbatches))


def _run(world_size: int, num_microbatches: int, **layout: Any) -> LayoutRun:
    spec = RunSpec(**layout)
    return merge(run_on_ranks(train_layout, world_size, spec, num_microbatches, timeout=180))


def _assert_matches_reference(result: LayoutRun, reference: LayoutRun) -> None:
    assert result.losses == pytest.approx(reference.losses, abs=ATOL)
    assert result.grad_norms == pytest.approx(reference.grad_norms, abs=ATOL)
    assert_same_tensors(result.grads, reference.grads, ATOL)
    assert_same_tensors(result.params, reference.params, ATOL)


def test_tensor_parallel_2_matches_single_rank():
    result = _run(2, tp=2, num_microbatches=2, steps=2)
    _assert_matches_reference(result, _reference(2, 2, 2))


def test_pipeline_parallel_2_1f1b_matches_single_rank():
    result = _run(2, pp=2, num_microbatches=4, steps=2)
    _assert_matches_reference(result, _reference(2, 4, 2))


def test_data_parallel_2_with_clipping_matches_whole_batch_on_one_rank():
    # 3 optimizer steps with Adam and clip_grad=1.0 (the tiny GPT's grad norm is ~2-3, so the
    # clip is active): grads, grad norms and the updated weights match the 1-rank run.
    reference = _reference(2, 4, 3)
    assert max(reference.grad_norms) > 1.0, "clipping must be active for this test to bite"
    result = _run(2, num_microbatches=4, steps=3)
    _assert_matches_reference(result, reference)


def test_interleaved_pipeline_pp2_vpp2_matches_single_rank():
    # 5 steps: the PP=2 batch_p2p_comm swap trap shows as a growing grad norm after a few steps.
    result = _run(2, pp=2, vpp=2, num_layers=4, num_microbatches=4, steps=5)
    _assert_matches_reference(result, _reference(4, 4, 5))


def test_tensor_2_by_pipeline_2_on_four_ranks_matches_single_rank():
    result = _run(4, tp=2, pp=2, num_microbatches=4, steps=2)
    _assert_matches_reference(result, _reference(2, 4, 2))


def test_sequence_parallel_tp2_matches_single_rank():
    # Local-spec LayerNorms under SP rely on the emulation's norm patch + finalize_model_grads.
    result = _run(2, tp=2, sequence_parallel=True, num_microbatches=2, steps=2)
    _assert_matches_reference(result, _reference(2, 2, 2))
