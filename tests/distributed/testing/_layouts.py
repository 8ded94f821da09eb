"""Shared worker for the megatron-core parity tests: train the tiny GPT under one layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from helpers.distributed import RunSpec
from megatron.core import parallel_state as ps

from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.testing.training import (
    build_training,
    forward_backward,
    gather_full_tensors,
    make_microbatches,
    optimizer_step,
)

SEQ = 16


@dataclass(frozen=True)
class LayoutRun:
    """One rank of :func:`train_layout`, or all ranks combined by :func:`merge`.

    ``losses[step]``: this DP rank's microbatch losses (last PP stage only), merged: the global
    mean. ``grads`` after the first backward and ``params`` after the last step are TP-gathered
    by canonical name, per rank only from TP rank 0 / DP rank 0 of each stage (else empty).
    """

    losses: list[Any] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def train_layout(rank: int, spec: RunSpec, num_microbatches: int) -> LayoutRun:
    """Train ``spec.steps`` optimizer steps of the tiny GPT under the layout in ``spec``.

    Every step consumes the same global batch of ``num_microbatches`` microbatches; data parallel
    rank ``d`` of ``DP`` takes the ``d``-th contiguous ``1/DP`` of them.
    """
    init_megatron_state(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
    )
    setup = build_training(
        num_layers=spec.num_layers,
        use_distributed_optimizer=spec.distributed_optimizer,
        bf16=spec.bf16,
        sequence_parallel=spec.sequence_parallel,
    )
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_microbatches(num_microbatches, spec.mbs, SEQ)
    per_rank = len(batches) // dp
    local = batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    reporter = ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    losses, grad_norms, grads = [], [], {}
    for step in range(spec.steps):
        losses.append(forward_backward(setup, local))
        if step == 0:
            grads = gather_full_tensors(setup, grads=True)
        grad_norms.append(optimizer_step(setup))
    params = gather_full_tensors(setup, grads=False)
    if not reporter:
        grads, params = {}, {}
    return LayoutRun(losses, grad_norms, grads, params)


def merge(results: list[LayoutRun]) -> LayoutRun:
    """Combine per-rank results: global mean loss per step, grads/params of all stages."""
    merged = LayoutRun(grad_norms=results[0].grad_norms)
    for step in range(len(results[0].grad_norms)):
        values = [v for r in results for v in r.losses[step]]
        merged.losses.append(sum(values) / len(values))
    for r in results:
        merged.grads.update(r.grads)
        merged.params.update(r.params)
    return merged


def assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float
) -> None:
    """Same names and every tensor within ``atol`` (max abs diff reported on failure)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        diff = (actual[name] - value).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff:.3g} > {atol}"
