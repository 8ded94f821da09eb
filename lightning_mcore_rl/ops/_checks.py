"""Argument checks shared by the ops kernels; each raises `ValueError`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


# every check reads local metadata only (shapes, dtypes, `group.rank()`/`group.size()`, which never
# communicate), so a bad argument raises on every rank before any collective is entered
def group_rank_size(group: Any, name: str, allow_none: bool = False) -> tuple[int, int]:
    """`(rank, size)` of this process in `group`; `(0, 1)` for `None` if `allow_none`.

    Raises:
        ValueError: `group` is `None` while required, or has no `rank()`/`size()` (not a member).
    """
    if group is None:
        if allow_none:
            return 0, 1
        raise ValueError(
            f"`{name}` is required (process groups are explicit); pass the group, e.g. Megatron's "
            f"parallel_state.get_tensor_model_parallel_group(), even when its size is 1"
        )
    if not (hasattr(group, "rank") and hasattr(group, "size")):
        raise ValueError(
            f"`{name}` must be a torch.distributed ProcessGroup this rank belongs to, got {group!r}"
        )
    return int(group.rank()), int(group.size())


def all_reduce(tensor: torch.Tensor, group: Any, op: dist.ReduceOp.RedOpType) -> None:
    """In-place all-reduce over ``group``; a no-op for a group of size 1 (no communication)."""
    if group is not None and group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)


def check_vocab_shard(
    logits: torch.Tensor, vocab_start: int, vocab_end: int, tp_group: Any, name: str = "logits"
) -> tuple[int, int]:
    """Check that `logits [..., V/TP]` is TP rank `r`'s contiguous shard `[r*V/TP, (r+1)*V/TP)`;
    returns `(tp_rank, tp_size)`."""
    tp_rank, tp_size = group_rank_size(tp_group, "tp_group")
    if not logits.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {logits.dtype}")
    local_vocab = logits.shape[-1]
    if vocab_end - vocab_start != local_vocab:
        raise ValueError(
            f"vocab range [{vocab_start}, {vocab_end}) has {vocab_end - vocab_start} ids but "
            f"`{name}` has a local vocab of {local_vocab} (shape {tuple(logits.shape)})"
        )
    # every kernel assumes uniform contiguous sharding, as megatron's vocab-parallel output layer
    # has it
    if vocab_start != tp_rank * local_vocab:
        raise ValueError(
            f"`vocab_start_index` must be tp_rank * V_l = {tp_rank} * {local_vocab} = "
            f"{tp_rank * local_vocab} for uniform contiguous vocab sharding, got {vocab_start}"
        )
    return tp_rank, tp_size


def check_token_ids(ids: torch.Tensor, global_vocab: int, name: str) -> None:
    """Check that `ids` is an integer tensor with every id in `[0, global_vocab)`."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"`{name}` must be an integer tensor of token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    # a host sync, but an out-of-range id would otherwise gather garbage (or crash a device kernel)
    # after the collectives have started
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= global_vocab:
        raise ValueError(
            f"`{name}` holds ids in [{low}, {high}] but the vocab has {global_vocab} ids "
            f"(V_l * TP); every id must lie in [0, {global_vocab})"
        )


def check_chunk_size(chunk_size: int | None) -> None:
    """`chunk_size` is `None` (one chunk) or a positive int."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"`chunk_size` must be a positive int or None, got {chunk_size!r}")


def check_ndim(tensor: torch.Tensor, ndim: int, name: str, layout: str) -> None:
    """`tensor` has `ndim` dims (`layout` names them in the message)."""
    if tensor.dim() != ndim:
        raise ValueError(f"`{name}` must be {layout} ({ndim}-D), got shape {tuple(tensor.shape)}")


def seq_chunks(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """`[(start, stop), ...]` covering `range(length)` in pieces of `chunk_size`."""
    step = length if chunk_size is None else chunk_size
    return [(start, min(start + step, length)) for start in range(0, length, max(step, 1))]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' math dtype: fp32 for bf16/fp16/fp32 inputs, fp64 kept."""
    # fp64 stays fp64 so that gradcheck can run the kernels
    return torch.promote_types(dtype, torch.float32)


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in `compute_dtype` (no copy when it already is)."""
    return tensor.to(compute_dtype(tensor.dtype))
