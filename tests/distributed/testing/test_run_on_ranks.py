"""``run_on_ranks``: results in rank order, failures and hangs surface fast and clearly."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

from lightning_mcore_rl.testing import run_on_ranks


def _all_reduce_rank(rank: int, offset: int) -> tuple[int, int, int]:
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    return rank, dist.get_world_size(), int(value)


def _rank_one_raises(rank: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever


def _hang(rank: int) -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order():
    # all-reduce of (rank + 10) over 3 ranks = 10 + 11 + 12
    assert run_on_ranks(_all_reduce_rank, 3, 10) == [(r, 3, 33) for r in range(3)]


def test_a_failing_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 failed(.|\n)*ValueError: boom from rank 1"):
        run_on_ranks(_rank_one_raises, 2, timeout=60)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_a_hanging_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 2 s"):
        run_on_ranks(_hang, 2, timeout=2)
    assert time.monotonic() - start < 15
    assert not multiprocessing.active_children()


def test_bad_arguments_are_rejected_before_spawning():
    with pytest.raises(ValueError, match="`world_size` must be a positive int, got 0"):
        run_on_ranks(_hang, 0)
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(lambda rank: rank, 1)
