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
        # per sequence: gathering the whole row misplaces tokens (docs/behaviour-reference.md trap 3)
        if end > start:
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
    """Whether scalar loss reporting must include CP ranks: `data` is prepacked
    (`"packed_cu_seqlens"` in it), so its loss is CP-local."""
    return "packed_cu_seqlens" in data


def strip_context_parallel_local_loss_metric(
    metrics: dict[str, list[Any]], enabled: bool
) -> dict[str, list[Any]]:
    """`metrics` (per-microbatch lists) without the CP-local `"loss"` when `enabled`
    (`should_reduce_loss_across_context_parallel`), after it entered the global reduction."""
    if not enabled:
        return metrics
    return {key: value for key, value in metrics.items() if key != "loss"}
