"""THD packing: hand-computed boundaries, round trips, CP shards, parameters and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mcore_rl.data import (
    get_pack_sequence_parameters,
    pack_sequences,
    packed_position_ids,
    restore_packed_from_cp_shards,
    round_up,
    unpack_sequences,
)

I32 = torch.int32


def _rows(lengths: list[int], width: int) -> torch.Tensor:
    """``[B, S]`` with row i = 100*(i+1) + position for real tokens, 0 beyond the length."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, :length] = 100 * (i + 1) + torch.arange(length)
    return ids


def test_no_padding_concatenates_real_tokens_with_zero_length_sequences() -> None:
    ids = _rows([3, 0, 2], 4)
    full, local, params, cu, cu_padded = pack_sequences(ids, torch.tensor([3, 0, 2]))
    assert full.tolist() == [[100, 101, 102, 300, 301]]
    assert torch.equal(local, full)
    assert cu.tolist() == [0, 3, 3, 5] and cu.dtype == I32
    assert cu_padded.tolist() == [0, 3, 3, 5] and cu_padded.data_ptr() != cu.data_ptr()
    assert params.qkv_format == "thd"
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, field).tolist() == [0, 3, 3, 5]
    assert params.max_seqlen_q == params.max_seqlen_kv == 3


def test_individual_and_packed_multiple_last_span_absorbs_bin_padding() -> None:
    # spans round_up([5, 1, 3], 4) = [8, 4, 4] -> total 16 -> round_up(16, 24) = 24: last span 12
    ids = _rows([5, 1, 3], 6)
    full, _, params, cu, cu_padded = pack_sequences(
        ids, torch.tensor([5, 1, 3]), pad_individual=4, pad_packed_multiple=24
    )
    assert cu.tolist() == [0, 5, 6, 9]
    assert cu_padded.tolist() == [0, 8, 12, 24]
    assert params.max_seqlen_q == 12  # the last span after absorbing the bin padding
    expected = [100, 101, 102, 103, 104, 0, 0, 0, 200, 0, 0, 0, 300, 301, 302] + [0] * 9
    assert full.tolist() == [expected]


def test_pad_packed_to_sets_the_total() -> None:
    # spans [4, 0, 4] -> cumulative [0, 4, 4, 8]; pad_packed_to 16 overwrites the last entry
    _, _, params, _, cu_padded = pack_sequences(
        _rows([3, 0, 2], 4), torch.tensor([3, 0, 2]), pad_individual=4, pad_packed_to=16
    )
    assert cu_padded.tolist() == [0, 4, 4, 16]
    assert params.max_seqlen_q == 12


def test_cp2_shards_each_span_with_the_zigzag_rule() -> None:
    # CP=2, spans of 4 and 8: span [a0..a3] -> rank0 [a0, a3], rank1 [a1, a2];
    # span [b0..b7] -> rank0 [b0, b1, b6, b7], rank1 [b2..b5]
    ids = _rows([4, 6], 8)
    outs = [
        pack_sequences(ids, torch.tensor([4, 6]), pad_individual=4, cp_rank=r, cp_size=2)
        for r in range(2)
    ]
    assert outs[0].packed_local.tolist() == [[100, 103, 200, 201, 0, 0]]
    assert outs[1].packed_local.tolist() == [[101, 102, 202, 203, 204, 205]]
    assert packed_position_ids(outs[0].cu_seqlens_padded, 0, 2).tolist() == [[0, 3, 0, 1, 6, 7]]
    restored = restore_packed_from_cp_shards(
        [o.packed_local for o in outs], outs[0].cu_seqlens_padded
    )
    assert torch.equal(restored, outs[0].packed_full)


def test_position_ids_restart_per_span() -> None:
    cu_padded = torch.tensor([0, 3, 3, 5], dtype=I32)
    assert packed_position_ids(cu_padded).tolist() == [[0, 1, 2, 0, 1]]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    cp_size=st.sampled_from([1, 2, 4]),
    individual_factor=st.integers(1, 3),
    packed_factor=st.sampled_from([1, 2, 16]),
    extra_width=st.integers(0, 3),
    use_pad_to=st.booleans(),
)
def test_property_round_trip_and_cp_reassembly(
    lengths: list[int],
    cp_size: int,
    individual_factor: int,
    packed_factor: int,
    extra_width: int,
    use_pad_to: bool,
) -> None:
    cp_factor = 2 * cp_size if cp_size > 1 else 1
    pad_individual = cp_factor * individual_factor
    pad_packed_multiple = cp_factor * packed_factor if packed_factor > 1 else 1
    width = max(lengths) + extra_width
    if width == 0:
        width = 1
    spans_total = sum(round_up(n, pad_individual) for n in lengths)
    pad_packed_to = (
        round_up(spans_total + 5, pad_packed_multiple * cp_factor) if use_pad_to else None
    )
    ids = _rows(lengths, width)
    seq_lengths = torch.tensor(lengths)
    outs = [
        pack_sequences(
            ids, seq_lengths, pad_individual, pad_packed_multiple, pad_packed_to, rank, cp_size
        )
        for rank in range(cp_size)
    ]
    full, _, params, cu, cu_padded = outs[0]
    spans = (cu_padded[1:] - cu_padded[:-1]).tolist()
    # every span holds its sequence, is a multiple of pad_individual (last: of 2*CP)
    assert all(s >= n for s, n in zip(spans, lengths, strict=True))
    assert all(s % pad_individual == 0 for s in spans[:-1]) and spans[-1] % cp_factor == 0
    total = full.shape[1]
    assert total == int(cu_padded[-1])
    if pad_packed_to is not None:
        assert total == pad_packed_to
    else:
        assert total == round_up(spans_total, pad_packed_multiple)
    assert cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    needs_padding = pad_individual > 1 or pad_packed_multiple > 1 or pad_packed_to is not None
    assert params.max_seqlen_q == (max(spans) if needs_padding else max(lengths))
    # round trip: every real token comes back, padding is zero
    assert torch.equal(unpack_sequences(full, cu, cu_padded, width), ids)
    assert int((full != 0).sum()) == int((ids != 0).sum())
    # CP: each local row is T/CP and the shards reassemble the packed row
    assert all(o.packed_local.shape == (1, total // cp_size) for o in outs)
    restored = restore_packed_from_cp_shards([o.packed_local for o in outs], cu_padded)
    assert torch.equal(restored, full)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # (TP, SP, PP, CP, pad_individual, max_len, fp8) -> (pad_individual, multiple, pad_to)
        ((1, False, 1, 1, 1, 100, None), (1, 1, None)),
        ((2, False, 1, 1, 1, 100, None), (1, 1, None)),  # TP without SP adds nothing
        ((2, True, 1, 1, 2, 100, None), (2, 1, None)),
        ((1, False, 1, 2, 4, 100, None), (4, 1, None)),
        ((2, True, 1, 2, 8, 100, "tensorwise"), (8, 16 * 4 * 2, None)),
        ((1, False, 1, 1, 1, 100, "delayed"), (1, 16, None)),
        ((1, False, 1, 1, 1, 100, "blockwise"), (1, 128, None)),
        ((1, False, 1, 2, 4, 100, "mxfp8"), (4, 32 * 4, None)),
        ((1, False, 2, 1, 1, 100, None), (1, 1, 100)),
        ((1, False, 2, 2, 4, 100, "tensorwise"), (4, 64, 128)),  # round_up(100, 16*2*2)
    ],
)
def test_get_pack_sequence_parameters(kwargs: tuple, expected: tuple) -> None:
    tp, sp, pp, cp, pad, max_len, fp8 = kwargs
    result = get_pack_sequence_parameters(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        pad_individual=pad,
        max_seq_len_in_batch=max_len,
        fp8=fp8,
    )
    assert result == expected


def _params(**overrides: object) -> dict[str, object]:
    base = {
        "tensor_model_parallel_size": 1,
        "sequence_parallel": False,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "pad_individual": 1,
        "max_seq_len_in_batch": 64,
    }
    return {**base, **overrides}


def test_get_pack_sequence_parameters_errors() -> None:
    with pytest.raises(ValueError, match=r"`pad_individual`=2 must be a multiple of 4.*2\*CP"):
        get_pack_sequence_parameters(**_params(context_parallel_size=2, pad_individual=2))
    with pytest.raises(ValueError, match=r"`pad_individual`=4 must be a multiple of 8"):
        get_pack_sequence_parameters(
            **_params(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                context_parallel_size=2,
                pad_individual=4,
            )
        )
    with pytest.raises(ValueError, match=r"`fp8` must be None or one of .*got 'e4m3'"):
        get_pack_sequence_parameters(**_params(fp8="e4m3"))
    with pytest.raises(ValueError, match=r"`context_parallel_size` must be >= 1, got 0"):
        get_pack_sequence_parameters(**_params(context_parallel_size=0))


def test_pack_sequences_errors() -> None:
    ids = _rows([3, 2], 4)
    with pytest.raises(ValueError, match=r"`seq_lengths` must lie in \[0, S=4\], got min 2, max 5"):
        pack_sequences(ids, torch.tensor([5, 2]))
    with pytest.raises(ValueError, match=r"`seq_lengths` must have shape \[B\]=\(2,\), got \(3,\)"):
        pack_sequences(ids, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"`seq_lengths` must be an integer tensor"):
        pack_sequences(ids, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"`input_ids` must be \[B, S\], got shape \(4,\)"):
        pack_sequences(ids[0], torch.tensor([3]))
    with pytest.raises(ValueError, match=r"`pad_individual`=2 must be a multiple of 2\*CP=4"):
        pack_sequences(ids, torch.tensor([3, 2]), pad_individual=2, cp_size=2)
    with pytest.raises(ValueError, match=r"`pad_packed_to`=12 must be a multiple of"):
        pack_sequences(ids, torch.tensor([3, 2]), pad_packed_multiple=8, pad_packed_to=12)
    with pytest.raises(ValueError, match=r"`pad_packed_to`=4 is smaller than the packed length 5"):
        pack_sequences(ids, torch.tensor([3, 2]), pad_packed_to=4)
    with pytest.raises(ValueError, match=r"last span .* not a multiple of 2\*CP=4"):
        pack_sequences(ids, torch.tensor([3, 2]), pad_individual=4, pad_packed_to=10, cp_size=2)
    with pytest.raises(ValueError, match=r"`pad_individual` must be >= 1, got 0"):
        pack_sequences(ids, torch.tensor([3, 2]), pad_individual=0)
    with pytest.raises(ValueError, match=r"`width`=2 is smaller than the longest sequence 3"):
        out = pack_sequences(ids, torch.tensor([3, 2]))
        unpack_sequences(out.packed_full, out.cu_seqlens, out.cu_seqlens_padded, 2)
