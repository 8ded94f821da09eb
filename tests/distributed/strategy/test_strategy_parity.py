"""``Trainer`` + ``MCoreRLStrategy`` trains exactly like the bare megatron loop.

Each test runs, in the same gloo ranks, the bare loop of ``lightning_mcore_rl.testing.training``
and a Lightning ``fit`` on the same batches. The per-microbatch losses and megatron's grad norms
are compared BITWISE (Python float ==); the logged ``train_loss`` (a DP/PP-reduced mean) is
within 1e-6 of the bare loop's global mean and identical on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _strategy_runs import FitResult, fit_rank
from helpers.distributed import RunSpec

from lightning_mcore_rl.testing import run_on_ranks


def _check(results: list[FitResult], spec: RunSpec) -> None:
    steps = spec.steps
    for r in results:
        assert r.global_step == steps
        assert len(r.metrics) == steps
    # Logged metrics identical on all ranks (incl. pipeline stage 0, which has no loss of its own).
    for step in range(steps):
        assert len({tuple(sorted(r.metrics[step].items())) for r in results}) == 1
    last_stage = [r for r in results if r.bare.losses[0]]
    for r in last_stage:
        bare = r.bare
        assert [tuple(x) for x in bare.losses] == r.microbatch_losses  # bitwise
        assert bare.grad_norms == r.grad_norms  # bitwise (megatron's fp64 norm)
        logged = [m["grad_norm"] for m in r.metrics]  # Lightning logs fp32 tensors
        assert logged == [float(torch.tensor(g, dtype=torch.float32)) for g in bare.grad_norms]
    for step in range(steps):
        values = [v for r in last_stage for v in r.bare.losses[step]]
        # Each DP rank's mean is in every last-stage TP rank; average over distinct DP ranks.
        expected = sum(values) / len(values)
        assert results[0].metrics[step]["train_loss"] == pytest.approx(expected, abs=1e-6)


def _run(world_size: int, **options: Any) -> list[FitResult]:
    spec = RunSpec(**options)  # steps=3, rows=32, global_batch=4 unless given
    results = run_on_ranks(fit_rank, world_size, spec, timeout=120)
    _check(results, spec)
    return results


def test_tp2_matches_bare_loop_and_tp_ranks_read_the_same_batches():
    results = _run(2, tp=2)
    assert [r.sampler for r in results] == [{"num_replicas": 1, "rank": 0}] * 2
    assert results[0].batch_sums == results[1].batch_sums


def test_pp2_1f1b_matches_bare_loop_and_stage0_logs_the_last_stage_loss():
    results = _run(2, pp=2, global_batch=8)  # 4 microbatches
    assert results[0].bare.losses[0] == []  # stage 0 has no loss of its own


def test_dp2_with_gradient_clipping_matches_bare_loop():
    results = _run(2, clip=0.5)
    assert [r.sampler for r in results] == [{"num_replicas": 2, "rank": d} for d in (0, 1)]
    assert min(results[0].bare.grad_norms) > 0.5, "clipping must be active"


def test_dp2_distributed_optimizer_matches_bare_loop():
    _run(2, distributed_optimizer=True, clip=1.0)


def test_pp2_vpp2_interleaved_matches_bare_loop():
    _run(2, pp=2, vpp=2, num_layers=4, global_batch=8)


def test_tp2_by_pp2_on_four_ranks_matches_bare_loop():
    _run(4, tp=2, pp=2, global_batch=8, steps=2)


def test_tp2_bf16_mixed_matches_bare_bf16_loop():
    # precision="bf16-mixed" -> Float16Module with bf16 params + fp32 main params in megatron's
    # optimizer, exactly what the bare loop builds with bf16=True: bitwise equal as well.
    _run(2, tp=2, bf16=True, clip=1.0)
