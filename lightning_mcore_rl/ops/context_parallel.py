"""Context-parallel (CP) zigzag sequence layout.

Megatron's load-balanced CP layout splits the sequence dim into ``2*CP`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2*CP-1-r``, concatenated in that order, so causal-attention work is equal
on every rank. Example, CP=2 and 16 tokens: rank 0 holds ``[0..3, 12..15]``, rank 1 ``[4..11]``.
"""

from __future__ import annotations

import torch


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
