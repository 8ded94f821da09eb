"""`BatchedDataDict`: a dict of per-sample tensors and lists that share dim 0."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch

Value = torch.Tensor | list[Any]


class BatchedDataDict(dict[str, Value]):
    """A `dict[str, Tensor | list]` of `B` samples: tensors `[B, ...]`, lists of `B` entries;
    tensors of two or more dims are per-token `[B, S, ...]` and share the width `S`
    (`input_ids [B, S]`, `input_lengths [B]`, `token_mask [B, S]`, `sample_mask [B]`, ...)."""

    @property
    def size(self) -> int:
        """`B`, the shared dim-0 size (0 if empty); raises `ValueError` if values disagree."""
        sizes = {key: _batch_len(value) for key, value in self.items()}
        if not sizes:
            return 0
        distinct = set(sizes.values())
        if len(distinct) != 1:
            raise ValueError(
                f"BatchedDataDict values must share dim 0, got sizes {sizes}; every tensor must be "
                "[B, ...] and every list must have B entries."
            )
        return distinct.pop()

    def sequence_width(self, reference_key: str = "input_ids") -> int:
        """The shared width `S`: dim 1 of `reference_key` and of every other per-token tensor;
        raises `ValueError` if `reference_key` is missing or not 2-D, or the widths are ragged."""
        if reference_key not in self:
            raise ValueError(f"batch has no `{reference_key}` key; keys: {sorted(self)}")
        reference = self[reference_key]
        if not isinstance(reference, torch.Tensor) or reference.ndim < 2:
            raise ValueError(
                f"`{reference_key}` must be a [B, S] tensor, got {_describe(reference)}"
            )
        width = reference.shape[1]
        for key, value in self.items():
            # every tensor of two or more dims is per-token (`teacher_topk_logits [B, S, K]` too),
            # so all share S
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] != width:
                raise ValueError(
                    f"ragged widths: `{key}` has shape {tuple(value.shape)} but "
                    f"`{reference_key}` has width S={width}; every per-token tensor must be "
                    f"[B, {width}, ...]."
                )
        return width

    def validate(
        self,
        required_keys: Iterable[str] = ("input_ids", "input_lengths", "sample_mask"),
        length_key: str = "input_lengths",
    ) -> None:
        """Check the data contract: required keys, shared dim 0, shared width,
        `0 <= length_key <= S`; raises `ValueError` naming the offending key, the expected and the
        actual value."""
        missing = [key for key in required_keys if key not in self]
        if missing:
            raise ValueError(
                f"batch is missing required keys {missing}; present keys: {sorted(self)}"
            )
        batch_size = self.size
        if "input_ids" in self:
            width = self.sequence_width("input_ids")
            if length_key in self:
                lengths = torch.as_tensor(self[length_key])
                if lengths.shape != (batch_size,):
                    raise ValueError(
                        f"`{length_key}` must have shape [B]=({batch_size},), got "
                        f"{tuple(lengths.shape)}"
                    )
                # a length beyond S would index past the row when packing and masking
                if lengths.numel() and (int(lengths.max()) > width or int(lengths.min()) < 0):
                    raise ValueError(
                        f"`{length_key}` must lie in [0, S={width}], got min "
                        f"{int(lengths.min())}, max {int(lengths.max())}"
                    )

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """A new batch of the samples at `indices [b]` (in that order)."""
        index = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        out = BatchedDataDict()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                # the index moves to each value's device: a batch may hold CPU and device tensors
                out[key] = value.index_select(0, index.to(value.device))
            else:
                out[key] = [value[i] for i in index.tolist()]
        return out

    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Samples `[start, end)` (tensor values are views); raises `ValueError` out of range."""
        size = self.size
        if not 0 <= start <= end <= size:
            raise ValueError(f"slice [{start}, {end}) is out of range for a batch of size {size}")
        return BatchedDataDict({key: value[start:end] for key, value in self.items()})

    def truncate_width(self, width: int) -> BatchedDataDict:
        """The first `width <= S` positions of every per-token tensor (views `[B, width, ...]`);
        others unchanged."""
        current = self.sequence_width()
        if not 0 < width <= current:
            raise ValueError(f"`width` must be in [1, S={current}], got {width}")
        return BatchedDataDict(
            {
                key: value[:, :width]
                if isinstance(value, torch.Tensor) and value.ndim >= 2
                else value
                for key, value in self.items()
            }
        )

    def shard_indices(
        self,
        shards: int,
        batch_size: int | None = None,
        balance_lengths: bool = False,
        length_key: str = "input_lengths",
    ) -> list[torch.Tensor]:
        """Sample indices `[size / shards]` of each DP shard (see `shard_by_batch_size`)."""
        size = self.size
        batch_size = size if batch_size is None else batch_size
        if shards < 1:
            raise ValueError(f"`shards` must be >= 1, got {shards}")
        if batch_size < 1 or size % batch_size != 0:
            raise ValueError(
                f"batch size {size} is not divisible by `batch_size`={batch_size}; the batch must "
                "hold whole global batches."
            )
        if batch_size % shards != 0:
            raise ValueError(
                f"global batch size {batch_size} is not divisible by the number of data-parallel "
                f"shards {shards}; choose a global batch size that is a multiple of DP={shards}."
            )
        if balance_lengths and length_key not in self:
            raise ValueError(
                f"`balance_lengths=True` needs the per-sample length key `{length_key}`; keys: "
                f"{sorted(self)}"
            )
        per_shard: list[list[int]] = [[] for _ in range(shards)]
        for start in range(0, size, batch_size):
            chunk = list(range(start, start + batch_size))
            if balance_lengths:
                lengths = torch.as_tensor(self[length_key])[start : start + batch_size].tolist()
                # equal sample counts, balanced token sums; each piece keeps its samples in input
                # order
                groups = balanced_equal_count_partition(lengths, shards)
                pieces = [[chunk[i] for i in group] for group in groups]
            else:
                step = batch_size // shards
                # contiguous pieces: each shard still holds whole local batches in step order
                pieces = [chunk[r * step : (r + 1) * step] for r in range(shards)]
            for rank, piece in enumerate(pieces):
                per_shard[rank].extend(piece)
        return [torch.tensor(indices, dtype=torch.long) for indices in per_shard]

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        balance_lengths: bool = False,
        length_key: str = "input_lengths",
    ) -> list[BatchedDataDict]:
        """Split into `shards` data-parallel shards of `size / shards` samples, one global batch of
        `batch_size` (default: all) at a time, balancing `length_key [B]` sums if `balance_lengths`.

        Raises:
            ValueError: `size` not divisible by `batch_size` or `batch_size` by `shards`, or
                `length_key` missing when balancing.
        """
        indices = self.shard_indices(shards, batch_size, balance_lengths, length_key)
        return [self.select_indices(index) for index in indices]

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict]:
        """Fixed-size microbatches (slices) in order; `microbatch_size` must divide `size`."""
        size = self.size
        if microbatch_size < 1 or size % microbatch_size != 0:
            raise ValueError(
                f"batch size {size} is not divisible by `microbatch_size`={microbatch_size}"
            )
        return (self.slice(s, s + microbatch_size) for s in range(0, size, microbatch_size))

    def to(self, device: torch.device | str) -> BatchedDataDict:
        """A new batch with every tensor on `device` (lists unchanged)."""
        return BatchedDataDict(
            {
                key: value.to(device) if isinstance(value, torch.Tensor) else value
                for key, value in self.items()
            }
        )

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Value]],
        pad_values: Mapping[str, float] | None = None,
    ) -> BatchedDataDict:
        """Concatenate batches with identical keys along dim 0; per-token tensors of different
        widths are right-padded with `pad_values[key]` (default 0).

        Raises:
            ValueError: no batches, differing key sets, or tensors that differ beyond dim 1.
        """
        if not batches:
            raise ValueError("`batches` is empty; nothing to concatenate")
        keys = list(batches[0])
        for i, batch in enumerate(batches):
            if set(batch) != set(keys):
                raise ValueError(
                    f"batch {i} has keys {sorted(batch)}, expected the keys of batch 0 {sorted(keys)}"
                )
        pad_values = pad_values or {}
        out = cls()
        for key in keys:
            values = [batch[key] for batch in batches]
            if all(isinstance(v, torch.Tensor) for v in values):
                # rollouts of different lengths: per-token tensors are right-padded to the widest
                out[key] = _cat_padded(
                    key, cast(list[torch.Tensor], values), pad_values.get(key, 0)
                )
            elif all(isinstance(v, list) for v in values):
                out[key] = [item for value in values for item in value]
            else:
                raise TypeError(f"`{key}` mixes tensors and lists across batches")
        _ = out.size  # validates the shared dim 0
        return out


def balanced_equal_count_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """`parts` lists of `n / parts` indices (each increasing) of `lengths [n]`, equal counts with
    balanced sums; raises `ValueError` unless `n % parts == 0`."""
    count = len(lengths)
    if count % parts != 0:
        raise ValueError(f"{count} items cannot be split into {parts} groups of equal count")
    capacity = count // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    # greedy longest-processing-time: the longest item goes to the open group with the smallest sum
    for index in sorted(range(count), key=lambda i: (-lengths[i], i)):
        open_groups = [g for g in range(parts) if len(groups[g]) < capacity]
        target = min(open_groups, key=lambda g: (sums[g], g))
        groups[target].append(index)
        sums[target] += lengths[index]
    return [sorted(group) for group in groups]


def _batch_len(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise ValueError(
                "BatchedDataDict tensors must be at least 1-D ([B, ...]), got a scalar"
            )
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(f"BatchedDataDict values must be tensors or lists, got {type(value).__name__}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _cat_padded(key: str, tensors: list[torch.Tensor], pad_value: float) -> torch.Tensor:
    if any(t.ndim != tensors[0].ndim for t in tensors):
        raise ValueError(f"`{key}` has different ranks across batches: {[t.ndim for t in tensors]}")
    if tensors[0].ndim < 2:
        return torch.cat(tensors)
    trailing = {tuple(t.shape[2:]) for t in tensors}
    if len(trailing) != 1:
        raise ValueError(
            f"`{key}` differs beyond dim 1 across batches: shapes {[tuple(t.shape) for t in tensors]}"
        )
    width = max(t.shape[1] for t in tensors)
    padded = [
        torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, width - t.shape[1]), value=pad_value)
        for t in tensors
    ]
    return torch.cat(padded)
