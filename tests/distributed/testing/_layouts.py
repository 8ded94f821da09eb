"""Shared worker for the megatron-core parity tests: train the tiny GPT under one layout."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps

from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.testing.training import (
    build_training,
    forward_backward,
    gather_full_tensors,
    make_microbatches,
    optimizer_step,
)


def train_layout(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` optimizer steps of the tiny GPT under the layout in ``spec``.

    Every step consumes the same global batch of ``spec["num_microbatches"]`` microbatches; data
    parallel rank ``d`` of ``DP`` takes the ``d``-th contiguous ``1/DP`` of them.

    Returns (per rank): ``losses[step] = this DP rank's microbatch losses`` (last PP stage only),
    ``grad_norms``, the TP-gathered ``grads`` after the first backward and ``params`` after the
    last step (canonical names; only from TP rank 0 / DP rank 0 of each stage, else empty).
    """
    init_megatron_state(
        tensor_model_parallel_size=spec.get("tp", 1),
        pipeline_model_parallel_size=spec.get("pp", 1),
        virtual_pipeline_model_parallel_size=spec.get("vpp"),
    )
    setup = build_training(
        num_layers=spec.get("num_layers", 2),
        use_distributed_optimizer=spec.get("distributed_optimizer", False),
        bf16=spec.get("bf16", False),
        sequence_parallel=spec.get("sequence_parallel", False),
    )
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_microbatches(spec["num_microbatches"], spec.get("mbs", 2), spec.get("seq", 16))
    per_rank = len(batches) // dp
    local = batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    reporter = ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "grads": {}, "params": {}}
    for step in range(spec["steps"]):
        out["losses"].append(forward_backward(setup, local))
        if step == 0:
            grads = gather_full_tensors(setup, grads=True)
            out["grads"] = grads if reporter else {}
        out["grad_norms"].append(optimizer_step(setup))
    params = gather_full_tensors(setup, grads=False)
    out["params"] = params if reporter else {}
    return out


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine per-rank results: global mean loss per step, grads/params of all stages."""
    steps = len(results[0]["grad_norms"])
    losses = []
    for step in range(steps):
        values = [v for r in results for v in r["losses"][step]]
        losses.append(sum(values) / len(values))
    grads: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for r in results:
        grads.update(r["grads"])
        params.update(r["params"])
    return {
        "losses": losses,
        "grad_norms": results[0]["grad_norms"],
        "grads": grads,
        "params": params,
    }


def assert_same_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float
) -> None:
    """Same names and every tensor within ``atol`` (max abs diff reported on failure)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        diff = (actual[name] - value).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff:.3g} > {atol}"
