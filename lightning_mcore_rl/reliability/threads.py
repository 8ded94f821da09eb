"""One torch intra-op thread count on every rank, fixed when the strategy sets up."""

# megatron keeps TP-replicated parameters (layer norms, learned position embeddings, row-parallel
# biases) identical across a replica's TP ranks only by computing their gradients identically.
# Torch's CPU kernels split a reduction into one chunk per intra-op thread, so ranks with
# different thread counts round those gradients apart (docs/reliability.md), and the checkpoint
# stores one copy: a resumed rank continues from its peer's. Counts differ whenever a rank
# starts with its own (`torch.set_num_threads` in a script, nodes with different core counts,
# `OMP_NUM_THREADS` per node). One count, agreed once at set-up, costs nothing per step;
# reducing the replicated gradients instead would cost a TP collective every step.

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist


def check_intra_op_threads(value: Any) -> None:
    """Validate `ReliabilityConfig.intra_op_threads` (a positive int or `None`).

    Raises:
        TypeError: not an int (a bool is not a count) or None.
        ValueError: below 1.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            "`ReliabilityConfig.intra_op_threads` must be an int or None, got "
            f"{type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"`ReliabilityConfig.intra_op_threads` must be >= 1, got {value}.")


def set_intra_op_threads(requested: int | None, group: Any, device: torch.device) -> int:
    """Set torch's intra-op thread count to `requested` (`None`: the smallest any rank of
    `group` runs, one all-reduce on `device`) and return it; a rank whose count changes warns."""
    current = torch.get_num_threads()
    target = requested
    if target is None:
        # MIN: no rank uses more threads than it had (its count was sized to its share of cores)
        count = torch.tensor([current], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        target = int(count.item())
    if target != current:
        rank = dist.get_rank()
        rule = "" if requested is not None else ": the smallest count of any rank"
        warnings.warn(
            f"rank {rank}: torch intra-op threads {current} -> {target} "
            f"(`ReliabilityConfig(intra_op_threads={requested})`{rule}; one count on every rank "
            "keeps TP-replicated parameters bitwise identical).",
            stacklevel=2,
        )
        torch.set_num_threads(target)
    return target


__all__ = ["set_intra_op_threads", "check_intra_op_threads"]
