"""Context-parallel (CP) zigzag sequence layout: 2*CP chunks, rank `r` holds chunks `r` and
`2*CP-1-r` (CP=2, 16 tokens: rank 0 `[0..3, 12..15]`, rank 1 `[4..11]`)."""

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


# the zigzag pairs an early chunk with a late one so that causal-attention work is equal on every CP
# rank
def get_tokens_on_this_cp_rank(
    tensor: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> torch.Tensor:
    """This CP rank's zigzag shard `[..., S/CP, ...]` of `tensor [..., S, ...]` along `seq_dim`
    (`tensor` itself when CP == 1).

    Raises:
        ValueError: bad `cp_rank`/`cp_size`, or `S % (2*CP) != 0`.
    """
    _check_cp_args(tensor.shape[seq_dim], cp_rank, cp_size, seq_dim)
    if cp_size == 1:
        return tensor
    chunks = tensor.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def cp_zigzag_chunk_order(cp_size: int) -> list[int]:
    """Global chunk index of each of the `2*CP` chunks of the rank-major concatenated shards
    (`[0, 2CP-1, 1, 2CP-2, ...]`)."""
    order: list[int] = []
    for rank in range(cp_size):
        order += [rank, 2 * cp_size - 1 - rank]
    return order


def restore_from_cp_shards(shards: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `get_tokens_on_this_cp_rank`: `CP` shards `[..., S/CP, ...]` (rank `r` at index
    `r`) -> `[..., S, ...]` in token order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    halves = [half for shard in shards for half in shard.chunk(2, dim=seq_dim)]
    by_global_index = dict(zip(cp_zigzag_chunk_order(cp_size), halves, strict=True))
    return torch.cat([by_global_index[i] for i in range(2 * cp_size)], dim=seq_dim)


class _AllGatherCPTensor(torch.autograd.Function):
    """`local [..., S/CP, ...]` -> `full [..., S, ...]`: all-gather over CP and undo the zigzag;
    backward: all-reduce SUM over CP, then keep this rank's chunks."""

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
        # every CP rank used the full tensor: its gradient is the sum over CP, of which this rank
        # keeps its own chunks (the dual of the forward all-gather)
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.cp_group)
        cp_group = ctx.cp_group
        local = get_tokens_on_this_cp_rank(grad, cp_group.rank(), cp_group.size(), ctx.seq_dim)
        return local, None, None


def allgather_cp_sharded_tensor(
    tensor: torch.Tensor, cp_group: Any, seq_dim: int = 1
) -> torch.Tensor:
    """Differentiable all-gather of a zigzag CP shard `[..., S/CP, ...]` into `[..., S, ...]` in
    token order, identical on every CP rank (`tensor` itself for no group or CP == 1).

    Raises:
        ValueError: `seq_dim` out of range, or an odd shard length.
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
    # backward sums over CP: a loss computed identically on every CP rank gets CP times its
    # gradient, so divide it by CP exactly once (docs/behaviour-reference.md trap 4)
    return _AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


class _AllGatherToPositions(torch.autograd.Function):
    """`local [n, ...]` -> `full [CP*n, ...]` with `full[positions[r*n + j]] = local_r[j]`;
    backward: a reduce-scatter SUM of each owner's rows."""

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
        # dlocal_r[j] = sum over ranks r' of dfull_r'[positions[r*n + j]]: every rank picks each
        # owner's rows out of its own full gradient and the reduce-scatter sums them at the owner
        picked = grad_full.index_select(0, positions).contiguous()  # [CP*n, ...] rank-major
        grad_local = picked.new_empty(picked.shape[0] // ctx.cp_group.size(), *picked.shape[1:])
        dist.reduce_scatter_tensor(grad_local, picked, group=ctx.cp_group)
        return grad_local, None, None


def allgather_cp_to_positions(
    local: torch.Tensor, positions: torch.Tensor, cp_group: Any
) -> torch.Tensor:
    """Differentiable all-gather of CP shards `[n, ...]` into `[CP*n, ...]` laid out by
    `positions [CP*n]` (rank `r`'s row `j` goes to `positions[r*n + j]`), identical on every rank.

    Raises:
        ValueError: `positions` is not 1-D of length `CP*n` (before any collective).
    """
    _, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    # the CP attention gathers a packed row's keys and values with this; `positions` is every rank's
    # `data.packing.cp_local_indices`, concatenated
    if positions.ndim != 1 or positions.numel() != cp_size * local.shape[0]:
        raise ValueError(
            f"`positions` must be 1-D of length CP*n = {cp_size}*{local.shape[0]}, got shape "
            f"{tuple(positions.shape)}"
        )
    if cp_size == 1:
        return local
    return cast(torch.Tensor, _AllGatherToPositions.apply(local, positions.long(), cp_group))
