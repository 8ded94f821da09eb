"""Exact mid-epoch resume of the data position (`ResumableLoader`)."""

# On `fit(ckpt_path=...)` Lightning restores `global_step` and `batch_idx`, but a plain
# `DataLoader` starts again at its first batch, so a mid-epoch resume replays the epoch's first
# batches (Lightning only warns). The loader's count of batches handed out is saved with the fit
# loop's state and given back before the resumed epoch starts; the loader then skips them.

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


class ResumableLoader:
    """A sized `DataLoader` wrapper whose position within the epoch is checkpointed; after
    `load_state_dict` the next `iter()` skips the batches already consumed in that epoch.

    Args:
        loader: a map-style (sized) `DataLoader` with its own `DistributedSampler`."""

    # The skipped batches are loaded and dropped, so the sampler's order is untouched. The count
    # is exact because Lightning does not prefetch from a loader with a length. Lightning does not
    # inject its distributed sampler into a wrapper, hence the wrapped loader's own
    # (`resumable_dataloader`); `sampler` is exposed so that Lightning's per-epoch `set_epoch`
    # (restored epoch included) reaches it.

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self._skip = 0
        self._yielded = 0
        self._source: Iterator[Any] | None = None  # the running epoch's batches not yet read
        self._ahead: deque[Any] = deque()  # read by peek(), not yet handed out

    @property
    def sampler(self) -> Any:
        """The wrapped loader's sampler (Lightning calls its `set_epoch` each epoch)."""
        return self.loader.sampler

    @property
    def dataset(self) -> Dataset:
        """The wrapped loader's dataset."""
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        """The wrapped loader's batch size."""
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if skip >= len(self.loader):  # saved after the epoch's last batch: the next one is fresh
            skip = 0
        self._yielded = skip
        self._ahead.clear()
        self._source = (batch for index, batch in enumerate(self.loader) if index >= skip)
        while self._ahead or self._fill(1):
            self._yielded += 1
            yield self._ahead.popleft()
        self._source = None

    def _fill(self, count: int) -> bool:
        """Read batches into the look-ahead until it holds ``count``; whether it does."""
        while len(self._ahead) < count and self._source is not None:
            batch = next(self._source, _END)
            if batch is _END:
                self._source = None
            else:
                self._ahead.append(batch)
        return len(self._ahead) >= count

    def peek(self, count: int = 1) -> list[Any]:
        """The next `count` batches of the running epoch, not handed out (fewer at its end, none
        outside an iteration); the iteration then yields the same objects.

        Raises:
            ValueError: `count` < 1."""
        # an asynchronous recipe starts their rollouts early; they are not consumed, so a resume
        # loads them again
        if count < 1:
            raise ValueError(f"`count` must be >= 1, got {count}")
        self._fill(count)
        return list(self._ahead)[:count]

    def state_dict(self) -> dict[str, int]:
        """``{"batches_yielded": n}``: batches of the current epoch handed out so far."""
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip the first ``state["batches_yielded"]`` batches on the next ``iter()``."""
        self._skip = self._yielded = int(state["batches_yielded"])


_END = object()
"""The end of the wrapped loader's batches."""


def resumable_dataloader(
    dataset: Dataset,
    trainer: Trainer,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    **loader_kwargs: Any,
) -> ResumableLoader:
    """A `ResumableLoader` over this data-parallel rank's share of `dataset` (`trainer`: set up,
    e.g. inside `train_dataloader`; `seed` the same on every rank; `loader_kwargs` go to the
    `DataLoader`)."""
    # MCoreRLStrategy's sampler kwargs are the DP size and rank, so all TP/PP/CP ranks of a
    # replica read the same samples (a single-device strategy gives 1/0). With `shuffle` the order
    # is fixed by `seed` and Lightning's `set_epoch`: every epoch differs, a resumed run sees the
    # same order; `shuffle=True, seed=0` is what Lightning's injected sampler gives.
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    sampler: DistributedSampler = DistributedSampler(
        dataset,
        num_replicas=kwargs.get("num_replicas", 1),
        rank=kwargs.get("rank", 0),
        shuffle=shuffle,
        seed=seed,
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs)
    return ResumableLoader(loader)
