"""BatchedDataDict: slicing, selection, DP sharding, microbatches, concatenation, validation."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.data import BatchedDataDict, balanced_equal_count_partition


def _batch(size: int = 8, width: int = 6) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.arange(size * width).reshape(size, width),
        input_lengths=torch.tensor([(i % width) + 1 for i in range(size)]),
        sample_mask=torch.ones(size),
        token_mask=torch.ones(size, width),
        prompt=[f"p{i}" for i in range(size)],
    )


def test_size_slice_select_and_to() -> None:
    batch = _batch()
    assert batch.size == 8 and BatchedDataDict().size == 0
    part = batch.slice(2, 5)
    assert part.size == 3 and part["prompt"] == ["p2", "p3", "p4"]
    assert torch.equal(part["input_ids"], batch["input_ids"][2:5])
    picked = batch.select_indices([6, 1])
    assert picked["prompt"] == ["p6", "p1"]
    assert torch.equal(picked["input_lengths"], torch.tensor([1, 2]))
    moved = batch.to("cpu")
    assert isinstance(moved, BatchedDataDict) and moved["prompt"] is batch["prompt"]


def test_shard_by_batch_size_takes_a_piece_of_every_global_batch() -> None:
    # 8 samples = 2 global batches of 4; DP=2 -> rank 0 gets [0, 1] + [4, 5]
    shards = _batch().shard_by_batch_size(2, batch_size=4)
    assert [s["prompt"] for s in shards] == [["p0", "p1", "p4", "p5"], ["p2", "p3", "p6", "p7"]]


def test_shard_by_batch_size_balances_lengths_with_equal_counts() -> None:
    lengths = [100, 90, 80, 70, 1, 2, 3, 4]
    batch = BatchedDataDict(input_lengths=torch.tensor(lengths), idx=list(range(8)))
    shards = batch.shard_by_batch_size(2, balance_lengths=True)
    sums = [int(s["input_lengths"].sum()) for s in shards]
    assert [s.size for s in shards] == [4, 4]
    assert sorted(i for s in shards for i in s["idx"]) == list(range(8))
    # contiguous halves give 340 / 10; greedy: 100+70+4+1 = 175 vs 90+80+3+2 = 175
    assert sums == [175, 175]


def test_balanced_partition_keeps_counts() -> None:
    groups = balanced_equal_count_partition([5, 5, 5, 5, 1, 1], 3)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_make_microbatch_iterator() -> None:
    microbatches = list(_batch().make_microbatch_iterator(4))
    assert [mb["prompt"][0] for mb in microbatches] == ["p0", "p4"]
    with pytest.raises(ValueError, match=r"batch size 8 is not divisible by `microbatch_size`=3"):
        _batch().make_microbatch_iterator(3)


def test_from_batches_concatenates_and_pads_widths() -> None:
    a = BatchedDataDict(input_ids=torch.ones(2, 3, dtype=torch.long), n=[1, 2])
    b = BatchedDataDict(input_ids=torch.full((1, 5), 2), n=[3])
    merged = BatchedDataDict.from_batches([a, b], pad_values={"input_ids": -1})
    assert merged["n"] == [1, 2, 3]
    assert merged["input_ids"].tolist() == [[1, 1, 1, -1, -1], [1, 1, 1, -1, -1], [2] * 5]
    with pytest.raises(ValueError, match=r"batch 1 has keys \['input_ids'\], expected"):
        BatchedDataDict.from_batches([a, BatchedDataDict(input_ids=torch.ones(1, 3))])
    with pytest.raises(ValueError, match=r"`batches` is empty"):
        BatchedDataDict.from_batches([])
    with pytest.raises(TypeError, match=r"`n` mixes tensors and lists"):
        BatchedDataDict.from_batches(
            [a, BatchedDataDict(input_ids=b["input_ids"], n=torch.ones(1))]
        )


def test_truncate_width() -> None:
    trimmed = _batch().truncate_width(2)
    assert trimmed["input_ids"].shape == (8, 2) and trimmed["token_mask"].shape == (8, 2)
    assert trimmed["input_lengths"].shape == (8,)
    with pytest.raises(ValueError, match=r"`width` must be in \[1, S=6\], got 7"):
        _batch().truncate_width(7)


def test_validation_errors() -> None:
    batch = _batch()
    batch.validate()
    bad = BatchedDataDict(batch)
    bad["token_mask"] = torch.ones(8, 5)
    with pytest.raises(ValueError, match=r"ragged widths: `token_mask` has shape \(8, 5\).*S=6"):
        bad.validate()
    bad = BatchedDataDict(batch)
    bad["sample_mask"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"must share dim 0, got sizes .*'sample_mask': 7"):
        bad.validate()
    bad = BatchedDataDict(batch)
    del bad["sample_mask"]
    with pytest.raises(ValueError, match=r"missing required keys \['sample_mask'\]"):
        bad.validate()
    bad = BatchedDataDict(batch)
    del bad["input_lengths"]
    with pytest.raises(ValueError, match=r"missing required keys \['input_lengths'\]"):
        bad.validate()
    bad = BatchedDataDict(batch)
    bad["input_lengths"] = torch.full((8,), 7)
    with pytest.raises(ValueError, match=r"`input_lengths` must lie in \[0, S=6\], got min 7"):
        bad.validate()
    with pytest.raises(TypeError, match=r"values must be tensors or lists, got int"):
        _ = BatchedDataDict(x=3).size
    with pytest.raises(ValueError, match=r"`input_ids` must be a \[B, S\] tensor"):
        BatchedDataDict(input_ids=torch.ones(3)).sequence_width()


def test_shard_errors() -> None:
    with pytest.raises(ValueError, match=r"global batch size 8 is not divisible by .* shards 3"):
        _batch().shard_by_batch_size(3)
    with pytest.raises(ValueError, match=r"batch size 8 is not divisible by `batch_size`=3"):
        _batch().shard_by_batch_size(1, batch_size=3)
    with pytest.raises(ValueError, match=r"`balance_lengths=True` needs .* `input_lengths`"):
        BatchedDataDict(x=torch.ones(4)).shard_by_batch_size(2, balance_lengths=True)
    with pytest.raises(ValueError, match=r"slice \[2, 9\) is out of range for a batch of size 8"):
        _batch().slice(2, 9)
