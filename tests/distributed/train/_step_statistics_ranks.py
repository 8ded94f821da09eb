"""Rank worker of the step-statistics tests: ``reduce_step_statistics`` at DP=2 on hand-made
per-microbatch metrics (no model: the reduction alone), with its collectives recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_rl.losses import MetricNormalizer
from lightning_mcore_rl.parallel import ParallelGroups, megatron_groups
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.train.statistics import StepOutput, reduce_step_statistics

NORMS = {
    "loss": MetricNormalizer.TOKENS,
    "kl": MetricNormalizer.TOKENS,
    "num_valid_samples": MetricNormalizer.NONE,
    "ratio_min": MetricNormalizer.MIN,
    "ratio_max": MetricNormalizer.MAX,
}


def microbatch_outputs(rank: int) -> list[dict[str, Any]]:
    """Two microbatches per rank, values depending on the rank (binary fractions: exact sums)."""
    return [
        {"loss": torch.tensor(0.25 + rank), "kl": torch.tensor(0.125 * (rank + 1)),
         "num_valid_samples": 2.0, "ratio_min": 0.5 + rank, "ratio_max": 1.5 - rank},
        {"loss": torch.tensor(0.5), "kl": 0.0625, "num_valid_samples": 1.0,
         "ratio_min": 0.75, "ratio_max": 1.25 + rank},
    ]  # fmt: skip


def counts(rank: int) -> dict[str, float]:
    return {"samples": 3.0, "tokens": 10.0 + rank, "response_tokens": 4.0 + rank,
            "responses": 3.0, "response_length_max": 2.0 + 3 * rank}  # fmt: skip


@dataclass(frozen=True)
class Recorded:
    """One reduction: its output (or error message) and the collectives it issued, in order."""

    output: StepOutput | None
    error: str | None
    calls: list[tuple[str, bool, bool]]  # (name, async_op, group is the DP (PP: broadcast) group)


def _reduce(
    rank: int,
    groups: ParallelGroups,
    undeclared_on: int | None = None,
    outputs: list[dict[str, Any]] | None = None,
    norms: dict[str, MetricNormalizer] = NORMS,
) -> Recorded:
    calls: list[tuple[str, bool, bool]] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}

    def recording(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            expected = groups.pp_group if name == "broadcast" else groups.dp_group
            calls.append((name, bool(kwargs.get("async_op")), group is expected))
            return originals[name](*args, **kwargs)

        return call

    outputs = microbatch_outputs(rank) if outputs is None else outputs
    if rank == undeclared_on:
        outputs[1]["surprise"] = 1.0
    for name in originals:
        setattr(dist, name, recording(name))
    try:
        out = reduce_step_statistics(
            outputs, counts(rank), groups, normalizations=norms, source="TestLoss"
        )
        return Recorded(out, None, calls)
    except ValueError as err:
        return Recorded(None, str(err), calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def statistics_run(rank: int) -> dict[str, Recorded]:
    """DP=2 (the 2-rank world): a clean step, then one with an undeclared metric on rank 1."""
    init_megatron_state()
    groups = megatron_groups()
    assert groups.dp_size == 2
    return {"clean": _reduce(rank, groups, None), "undeclared": _reduce(rank, groups, 1)}


MANY = 2000
"""Metrics of the large-payload step: its pickle is over the 16 KiB broadcast buffer."""


def pipeline_run(rank: int) -> dict[str, Recorded]:
    """PP=2 (DP=1): the last stage (rank 1) reduces, the first one receives the broadcast; a
    step with the usual metrics, then one with :data:`MANY` metrics."""
    init_megatron_state(pipeline_model_parallel_size=2)
    groups = megatron_groups()
    last = groups.is_pipeline_last_stage
    many_norms = {"loss": MetricNormalizer.TOKENS}
    many_norms.update({f"metric_{i:04d}": MetricNormalizer.NONE for i in range(MANY)})
    many = [{"loss": torch.tensor(0.5), **{f"metric_{i:04d}": float(i) for i in range(MANY)}}]
    return {
        "small": _reduce(rank, groups, outputs=microbatch_outputs(0) if last else []),
        "large": _reduce(rank, groups, outputs=many if last else [], norms=many_norms),
    }
