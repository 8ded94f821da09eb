"""CP/packing layout helpers of the step (``ParallelGroups`` itself lives in ``parallel/``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.ops import (
    allgather_cp_sharded_tensor,
)
from lightning_mcore_rl.parallel import host_ints

OutputProcessor = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
CP_NEEDS_PACKING = "Context Parallelism (CP>1) requires sequence packing to be enabled."


def gather_packed_over_cp(local: Tensor, cu: list[int], cp_group: Any) -> Tensor:
    """``[1, T/CP, ...]`` per-span zigzag shards -> ``[1, T, ...]``, one all-gather per span."""
    cp_size = cp_group.size()
    full = local.new_zeros(1, cu[-1], *local.shape[2:])
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        if (
            end > start
        ):  # per sequence: gathering the whole row misplaces tokens (docs/behaviour-reference.md trap 3)
            span = local[:, start // cp_size : end // cp_size]
            full[:, start:end] = allgather_cp_sharded_tensor(span, cp_group, seq_dim=1)
    return full


def unpack_rows(full: Tensor, cu: list[int], lengths: Tensor | Sequence[int], width: int) -> Tensor:
    """``[1, T, ...]`` -> ``[B, S, ...]`` zeros + row ``i``'s first ``min(len_i, S)`` tokens."""
    lens = host_ints(lengths)
    out = full.new_zeros(len(lens), width, *full.shape[2:])
    for i, length in enumerate(lens):
        n = min(length, width)
        out[i, :n] = full[0, cu[i] : cu[i] + n]
    return out


def should_reduce_loss_across_context_parallel(data: BatchedDataDict | dict[str, Any]) -> bool:
    """Whether scalar loss reporting must include CP ranks (direct prepacked data, CP-local loss).

    Args:
        data: The batch.

    Returns:
        True iff ``"packed_cu_seqlens"`` is a key of ``data``.
    """
    return "packed_cu_seqlens" in data


def strip_context_parallel_local_loss_metric(
    metrics: dict[str, list[Any]], enabled: bool
) -> dict[str, list[Any]]:
    """Remove the CP-local ``"loss"`` metric list after it entered the global reduction.

    Args:
        metrics: Per-microbatch metric lists keyed by name.
        enabled: Whether the losses were CP-local (`should_reduce_loss_across_context_parallel`).

    Returns:
        A new dict without ``"loss"`` when enabled, else ``metrics`` unchanged.
    """
    if not enabled:
        return metrics
    return {key: value for key, value in metrics.items() if key != "loss"}
