"""Contiguous tensor-parallel shards and host-side index lists, shared by every layer above."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def shard_range(local_size: int, rank: int) -> tuple[int, int]:
    """`[start, end)` of rank `rank`'s contiguous shard of `local_size` entries (the TP split of
    the vocabulary: rank r holds `[r * V/TP, (r + 1) * V/TP)`)."""
    return rank * local_size, (rank + 1) * local_size


def host_ints(values: Tensor | Sequence[int]) -> list[int]:
    """`values` (e.g. `cu_seqlens [n + 1]`) as Python ints, a tensor read to the host once."""
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


__all__ = ["host_ints", "shard_range"]
