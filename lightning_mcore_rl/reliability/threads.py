"""One torch intra-op thread count on every rank, fixed when the strategy sets up.

Why: megatron keeps TP-replicated parameters (layer norms, learned position embeddings, the
biases of row-parallel linears) identical across the TP ranks of a replica only by computing
their gradients identically on each rank, from identical inputs. Torch's CPU kernels split a
reduction (e.g. a layer-norm weight's gradient, a sum over tokens) into one chunk per intra-op
thread, so ranks running different thread counts round those gradients differently: measured
with the tiny GPT at TP=2 under Lightning's launcher, ranks started with 1 and 2 threads, 13 of
15 replicated tensors differed after 6 steps (max ``|p_rank0 - p_rank1|`` 1.2e-7). The
checkpoint stores one copy of each, so a resumed rank continues from its peer's copy and the run
is no longer the uninterrupted one. Counts differ whenever a rank starts with its own: a script
or library calling ``torch.set_num_threads``, nodes with different core counts (Lightning's
launcher gives each rank ``cpus // local processes``), ``OMP_NUM_THREADS`` set per node.

Fixing one count (one all-reduce at set-up) costs nothing per step and makes the replicated
parameters bitwise equal (the launch tests); reducing or broadcasting the replicated gradients
instead would cost a TP collective every step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist


def check_intra_op_threads(value: Any) -> None:
    """Validate ``ReliabilityConfig.intra_op_threads`` (a positive int or ``None``).

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
    """Set torch's intra-op thread count to the same value on every rank of ``group``.

    Collective on ``group`` when ``requested`` is ``None`` (one all-reduce, MIN): every rank
    takes the smallest count any rank runs, so no rank uses more threads than it had (its count
    was sized to its share of the cores). A rank whose count changes warns once, naming both
    counts.

    Args:
        requested: the count for every rank (``ReliabilityConfig.intra_op_threads``); ``None``:
            the smallest current count of any rank.
        group: the group of all ranks (the strategy's world group).
        device: where the all-reduce's one-element tensor lives (the backend's device).

    Returns:
        The count this rank now runs.
    """
    current = torch.get_num_threads()
    target = requested
    if target is None:
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
