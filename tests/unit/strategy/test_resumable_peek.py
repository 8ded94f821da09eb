"""``ResumableLoader.peek``: the batches after the last one handed out, read once, not counted as
consumed (a resume loads them again)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mcore_rl.strategy import ResumableLoader


def _loader() -> ResumableLoader:
    return ResumableLoader(DataLoader(torch.arange(10), batch_size=2))


def test_peek_shows_the_next_batches_and_iteration_yields_the_same_objects():
    loader = _loader()
    assert loader.peek() == []  # no iteration running
    batches = iter(loader)
    first = next(batches)
    assert first.tolist() == [0, 1]
    ahead = loader.peek(2)
    assert [b.tolist() for b in ahead] == [[2, 3], [4, 5]]
    assert loader.state_dict() == {"batches_yielded": 1}  # peeked batches are not consumed
    assert next(batches) is ahead[0] and next(batches) is ahead[1]
    assert loader.state_dict() == {"batches_yielded": 3}
    assert [b.tolist() for b in loader.peek(5)] == [[6, 7], [8, 9]]  # fewer at the epoch's end
    assert [b.tolist() for b in batches] == [[6, 7], [8, 9]]
    assert loader.peek() == []


def test_a_resume_loads_the_peeked_batches_again():
    loader = _loader()
    batches = iter(loader)
    next(batches)
    loader.peek(3)
    resumed = _loader()
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_peek_count_must_be_positive():
    with pytest.raises(ValueError, match="`count` must be >= 1, got 0"):
        _loader().peek(0)
