"""Helpers of the single-process unit tests."""

from __future__ import annotations


class FakeGroup:
    """A process group with ``rank()``/``size()`` only: any collective issued on it fails."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size
