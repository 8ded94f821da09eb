"""Property tests for the CP zigzag layout and the packed per-sequence rolls (no collectives)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mcore_rl.ops import (
    get_tokens_on_this_cp_rank,
    packed_local_targets,
    restore_from_cp_shards,
)
from lightning_mcore_rl.ops.logprobs import dense_local_targets


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 4),
    chunks=st.integers(1, 3),
    batch=st.integers(1, 3),
    seq_dim=st.sampled_from([0, 1]),
)
def test_zigzag_shard_then_restore_is_identity(
    cp: int, chunks: int, batch: int, seq_dim: int
) -> None:
    seq = 2 * cp * chunks
    full = torch.arange(batch * seq).view(batch, seq)
    if seq_dim == 0:
        full = full.t().contiguous()
    shards = [get_tokens_on_this_cp_rank(full, r, cp, seq_dim) for r in range(cp)]
    assert torch.equal(restore_from_cp_shards(shards, seq_dim), full)
    for rank, shard in enumerate(shards):
        assert shard.shape[seq_dim] == seq // cp
        # rank r holds chunks r and 2CP-1-r, in that order
        first, second = shard.chunk(2, dim=seq_dim) if cp > 1 else (shard, None)
        chunk_len = seq // (2 * cp)
        assert (
            int(first.select(seq_dim, 0).flatten()[0])
            == full.select(seq_dim, rank * chunk_len).flatten()[0]
        )
        if second is not None:
            start = (2 * cp - 1 - rank) * chunk_len
            assert (
                int(second.select(seq_dim, 0).flatten()[0])
                == full.select(seq_dim, start).flatten()[0]
            )


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(1, 3),
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5),
    tail=st.integers(0, 2),
)
def test_packed_rolls_stay_inside_each_padded_span(cp: int, lengths: list[int], tail: int) -> None:
    multiple = 2 * cp
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + -(-n // multiple) * multiple)
    total = cu[-1] + tail * multiple  # bin padding after the last sequence
    target = torch.arange(1, total + 1).view(1, total)  # distinct non-zero ids
    locals_ = [packed_local_targets(target, cu, total // cp, r, cp) for r in range(cp)]
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        shards = [local[:, start // cp : end // cp] for local in locals_]
        restored = restore_from_cp_shards(shards, seq_dim=1) if end > start else target[:, :0]
        assert torch.equal(restored, target[:, start:end].roll(-1, dims=1))
    for local in locals_:
        assert not local[:, cu[-1] // cp :].any()  # nothing written past the last span


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 3), batch=st.integers(1, 3), seq=st.integers(2, 20))
def test_dense_targets_shift_pad_shard(cp: int, batch: int, seq: int) -> None:
    local_len = -(-seq // (2 * cp)) * 2
    target = torch.arange(batch * seq).view(batch, seq) + 1
    shards = [dense_local_targets(target, local_len, r, cp) for r in range(cp)]
    full = restore_from_cp_shards(shards, seq_dim=1)
    assert full.shape == (batch, local_len * cp)
    assert torch.equal(full[:, :seq], target.roll(-1, dims=1))
    assert not full[:, seq:].any()
