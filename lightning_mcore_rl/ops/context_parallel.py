"""Context-parallel (CP) zigzag sequence layout.

Megatron's load-balanced CP layout splits the sequence dim into ``2*CP`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2*CP-1-r``, concatenated in that order, so causal-attention work is equal
on every rank. Example, CP=2 and 16 tokens: rank 0 holds ``[0..3, 12..15]``, rank 1 ``[4..11]``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_mcore_rl.ops._checks import group_rank_size


def _check_cp_args(length: int, cp_rank: int, cp_size: int, seq_dim: int) -> None:
    if cp_size < 1:
        raise ValueError(f"`cp_size` must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"`cp_rank` must be in [0, {cp_size}), got {cp_rank}")
    if cp_size > 1 and length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {length} (dim {seq_dim}) must be divisible by 2*CP = {2 * cp_size} "
            "for the zigzag context-parallel layout; pad the sequence to a multiple of 2*CP."
        )


def get_tokens_on_this_cp_rank(
    tensor: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """This CP rank's zigzag shard of ``tensor`` along ``seq_dim``.

    Args:
        tensor: ``[..., S, ...]`` with ``S`` at ``seq_dim``, ``S % (2*CP) == 0`` when CP > 1.
        cp_rank: rank in the context-parallel group.
        cp_size: context-parallel world size ``CP``.
        seq_dim: the sequence dimension.

    Returns:
        ``[..., S/CP, ...]``: chunks ``cp_rank`` and ``2*CP-1-cp_rank`` of ``2*CP``, in that order
        (``tensor`` itself when CP == 1).
    """
    _check_cp_args(tensor.shape[seq_dim], cp_rank, cp_size, seq_dim)
    if cp_size == 1:
        return tensor
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def cp_zigzag_chunk_order(cp_size: int) -> list[int]:
    """Global chunk index of each of the ``2*CP`` chunks in rank-major concatenated CP shards.

    Concatenating the shards of ranks ``0..CP-1`` gives chunks ``[0, 2CP-1, 1, 2CP-2, ...]``.
    """
    order: list[int] = []
    for rank in range(cp_size):
        order += [rank, 2 * cp_size - 1 - rank]
    return order


def restore_from_cp_shards(shards: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`get_tokens_on_this_cp_rank`: reassemble the full sequence.

    Args:
        shards: ``CP`` tensors ``[..., S/CP, ...]``, the shard of CP rank ``r`` at index ``r``.
        seq_dim: the sequence dimension.

    Returns:
        ``[..., S, ...]`` in original token order.
    """
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    halves = [half for shard in shards for half in shard.chunk(2, dim=seq_dim)]
    by_global_index = dict(zip(cp_zigzag_chunk_order(cp_size), halves, strict=True))
    return torch.cat([by_global_index[i] for i in range(2 * cp_size)], dim=seq_dim)


class _AllGatherCPTensor(torch.autograd.Function):
    """All-gather zigzag CP shards into the full sequence.

    Shapes: ``local [..., S/CP, ...]`` -> ``full [..., S, ...]`` (``S`` at ``seq_dim``).
    Forward: all-gather over ``cp_group``, then undo the zigzag order
    (:func:`restore_from_cp_shards`).
    Backward: all-reduce SUM of the upstream gradient over CP (every CP rank used the full tensor),
    then keep this rank's chunks ``r`` and ``2CP-1-r`` (:func:`get_tokens_on_this_cp_rank`).
    Dual pair: forward all-gather, backward reduce(-scatter) to the local zigzag shard.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, cp_group: Any, seq_dim: int) -> torch.Tensor:
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(cp_group.size())]
        dist.all_gather(shards, local, group=cp_group)
        ctx.cp_group = cp_group
        ctx.seq_dim = seq_dim
        return restore_from_cp_shards(shards, seq_dim=seq_dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.cp_group)
        cp_group = ctx.cp_group
        local = get_tokens_on_this_cp_rank(grad, cp_group.rank(), cp_group.size(), ctx.seq_dim)
        return local, None, None


def allgather_cp_sharded_tensor(
    tensor: torch.Tensor, cp_group: Any, seq_dim: int = 1
) -> torch.Tensor:
    """Differentiable all-gather of a zigzag CP-sharded tensor back to token order.

    Forward: all-gather + zigzag undo; backward: all-reduce SUM over CP + keep the local chunks, so
    a loss computed identically on every CP rank yields ``CP`` times its gradient (divide the loss
    by CP exactly once, docs/behaviour-reference.md trap 4).

    Args:
        tensor: ``[..., S/CP, ...]`` this CP rank's shard (chunks ``r`` and ``2CP-1-r``).
        cp_group: context-parallel group; ``None`` or a group of size 1 returns ``tensor``.
        seq_dim: the sequence dimension (may be negative).

    Returns:
        ``[..., S, ...]`` the full sequence in original order, identical on every CP rank.
    """
    _, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    ndim = tensor.dim()
    if not -ndim <= seq_dim < ndim:
        raise ValueError(
            f"`seq_dim` must be in [{-ndim}, {ndim}) for a {ndim}-D tensor, got {seq_dim}"
        )
    seq_dim %= ndim
    if cp_size == 1:
        return tensor
    if tensor.shape[seq_dim] % 2 != 0:
        raise ValueError(
            f"a zigzag CP shard holds two equal chunks, so its length along dim {seq_dim} must be "
            f"even, got {tensor.shape[seq_dim]} (shape {tuple(tensor.shape)})"
        )
    return _AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


class _AllGatherToPositions(torch.autograd.Function):
    """All-gather every CP rank's rows and put them at given positions of the full tensor.

    Shapes: ``local [n, ...]`` -> ``full [CP*n, ...]``; ``positions [CP*n]`` (a permutation of
    ``0..CP*n-1``, rank-major: ``positions[r*n + j]`` is where row ``j`` of rank ``r`` goes).
    Forward: ``full[positions[r*n + j]] = local_r[j]`` (all-gather, then one index copy).
    Backward: ``dlocal_r[j] = sum_{r'} dfull_{r'}[positions[r*n + j]]``: every rank picks each
    owner's rows out of its own full gradient and a reduce-scatter sums them at the owner.
    Dual pair: forward all-gather, backward reduce-scatter.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, positions: torch.Tensor, cp_group: Any) -> Any:
        local = local.contiguous()
        gathered = local.new_empty(cp_group.size() * local.shape[0], *local.shape[1:])
        dist.all_gather_single(gathered, local, group=cp_group)
        ctx.save_for_backward(positions)
        ctx.cp_group = cp_group
        return torch.empty_like(gathered).index_copy_(0, positions, gathered)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (positions,) = ctx.saved_tensors
        picked = grad_full.index_select(0, positions).contiguous()  # [CP*n, ...] rank-major
        grad_local = picked.new_empty(picked.shape[0] // ctx.cp_group.size(), *picked.shape[1:])
        dist.reduce_scatter_tensor(grad_local, picked, group=ctx.cp_group)
        return grad_local, None, None


def allgather_cp_to_positions(
    local: torch.Tensor, positions: torch.Tensor, cp_group: Any
) -> torch.Tensor:
    """Differentiable all-gather of CP shards into a full tensor laid out by ``positions``.

    The CP attention gathers a packed row's keys and values with it: each rank holds the zigzag
    shard of every span (``positions`` from
    :func:`~lightning_mcore_rl.data.packing.cp_local_indices` of each rank, concatenated).
    Forward: all-gather; backward: reduce-scatter (SUM) of the full gradient to the owners.

    Args:
        local: ``[n, ...]`` this rank's rows (the same ``n`` on every CP rank).
        positions: ``[CP*n]`` long: ``positions[r*n + j]`` is the full-tensor row of rank ``r``'s
            row ``j`` (a permutation, identical on every CP rank).
        cp_group: context-parallel group; ``None`` or a group of size 1 returns ``local``.

    Returns:
        ``[CP*n, ...]`` identical on every CP rank.

    Raises:
        ValueError: ``positions`` is not 1-D of length ``CP*n`` (before any collective).
    """
    _, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    if positions.ndim != 1 or positions.numel() != cp_size * local.shape[0]:
        raise ValueError(
            f"`positions` must be 1-D of length CP*n = {cp_size}*{local.shape[0]}, got shape "
            f"{tuple(positions.shape)}"
        )
    if cp_size == 1:
        return local
    return cast(torch.Tensor, _AllGatherToPositions.apply(local, positions.long(), cp_group))
