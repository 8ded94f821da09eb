"""The padding the parallel layout needs (``layout_padding``) and how ``split_global_batch``
applies it: packed spans a multiple of ``2*CP`` (times ``TP`` under SP), padded rows a multiple of
``TP`` under SP. Single process: size-1 fake groups, and the one DP all-reduce of the valid counts
(a sum over one rank) is the identity."""

from __future__ import annotations

import pytest
import torch
from helpers.unit import FakeGroup

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.train import Microbatching, ParallelGroups, process_microbatch
from lightning_mcore_rl.train.model_inputs import layout_padding
from lightning_mcore_rl.train.step import split_global_batch


@pytest.mark.parametrize(
    ("packing", "tp", "cp", "sp", "expected"),
    [
        (True, 1, 1, False, {"pad_individual": 1}),
        (True, 2, 1, False, {"pad_individual": 1}),  # TP alone splits no tokens
        (True, 2, 1, True, {"pad_individual": 2}),  # SP: T over TP
        (True, 1, 2, False, {"pad_individual": 4}),  # zigzag: 2*CP chunks per span
        (True, 2, 2, True, {"pad_individual": 8}),  # 2*CP chunks, each rank's T/CP over TP
        (False, 2, 1, False, {"pad_width_multiple": 1}),
        (False, 2, 1, True, {"pad_width_multiple": 2}),  # SP splits S over TP
    ],
)
def test_layout_padding(packing: bool, tp: int, cp: int, sp: bool, expected: dict) -> None:
    got = layout_padding(sequence_packing=packing, tp_size=tp, cp_size=cp, sequence_parallel=sp)
    assert got == expected


def _batch() -> BatchedDataDict:
    lengths = torch.tensor([5, 3, 7, 1])
    real = torch.arange(7)[None, :] < lengths[:, None]
    return BatchedDataDict(
        input_ids=torch.arange(1, 29).view(4, 7) * real,
        input_lengths=lengths,
        token_mask=real.float(),
        sample_mask=torch.ones(4),
    )


@pytest.fixture
def one_rank_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)


def _groups(tp: int, cp: int, cp_rank: int = 0) -> ParallelGroups:
    g = FakeGroup()
    return ParallelGroups(tp_group=g, tp_rank=0, tp_size=tp, pp_group=g, pp_rank=0, pp_size=1,
                          pp_last_rank=0, dp_group=g, dp_rank=0, dp_size=1, cp_group=g,
                          cp_rank=cp_rank, cp_size=cp)  # fmt: skip


@pytest.mark.usefixtures("one_rank_all_reduce")
def test_split_pads_packed_spans_for_cp_and_sp() -> None:
    microbatching = Microbatching(micro_batch_size=2, sequence_packing=True, sequence_parallel=True)
    batch = split_global_batch(_batch(), _groups(tp=2, cp=2, cp_rank=1), microbatching)
    # lengths (5, 3) and (7, 1): every span rounded up to 2*CP*TP = 8
    assert [mb.cu_seqlens_padded.tolist() for mb in batch.microbatches] == [[0, 8, 16]] * 2
    for mb in batch.microbatches:
        assert mb.input_ids_cp_sharded.shape == (1, 8)  # T/CP = 8, divisible by TP = 2
        # CP rank 1 holds chunks 1 and 2 of each span's 4 chunks: positions 2..5
        assert mb.position_ids.tolist() == [[2, 3, 4, 5, 2, 3, 4, 5]]
    assert batch.seq_length == 16


@pytest.mark.usefixtures("one_rank_all_reduce")
def test_split_pads_padded_rows_to_a_multiple_of_tp_under_sp() -> None:
    microbatching = Microbatching(micro_batch_size=2, sequence_parallel=True)
    batch = split_global_batch(_batch(), _groups(tp=2, cp=1), microbatching)
    for mb in batch.microbatches:
        assert mb.input_ids.shape == (2, 8) and mb.original_seq_length == 7
        assert mb.input_ids[:, 7].eq(0).all()
        assert mb.attention_mask is not None and mb.attention_mask.shape == (1, 1, 8, 8)
    assert batch.seq_length == 8
    plain = split_global_batch(_batch(), _groups(tp=2, cp=1), Microbatching(micro_batch_size=2))
    assert plain.seq_length == 7  # no SP: the rows keep their width


def test_pad_full_seq_to_must_respect_the_width_multiple() -> None:
    data = _batch()
    assert process_microbatch(data, pad_width_multiple=4).input_ids.shape == (4, 8)
    with pytest.raises(ValueError, match=r"`pad_full_seq_to`=10 must be >= the width S=7 and a "
                       r"multiple of `pad_width_multiple`=4"):  # fmt: skip
        process_microbatch(data, pad_full_seq_to=10, pad_width_multiple=4)
