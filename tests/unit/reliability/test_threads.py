"""``ReliabilityConfig.intra_op_threads`` and ``set_intra_op_threads`` (reliability/threads.py) on
two real gloo ranks started with different intra-op thread counts."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_mcore_rl.reliability.threads import set_intra_op_threads
from lightning_mcore_rl.strategy import ReliabilityConfig
from lightning_mcore_rl.testing import run_on_ranks


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("2", TypeError, r"`ReliabilityConfig.intra_op_threads` must be an int or None, got str"),
        (2.0, TypeError, r"intra_op_threads` must be an int or None, got float"),
        (True, TypeError, r"intra_op_threads` must be an int or None, got bool"),
        (0, ValueError, r"`ReliabilityConfig.intra_op_threads` must be >= 1, got 0"),
        (-3, ValueError, r"intra_op_threads` must be >= 1, got -3"),
    ],
)
def test_intra_op_threads_is_a_positive_int_or_none(value, error, match):
    with pytest.raises(error, match=match):
        ReliabilityConfig(intra_op_threads=value)


def test_intra_op_threads_defaults_to_the_smallest_count_of_any_rank():
    assert ReliabilityConfig().intra_op_threads is None
    assert ReliabilityConfig(intra_op_threads=3).intra_op_threads == 3


def _agree(rank: int, requests: list[int | None]) -> list[tuple[int, int, list[str]]]:
    """Per request: rank r starts with 2 + r threads (rank 0 too has more than one), then
    ``set_intra_op_threads``; returns the count returned, the count set and the warnings."""
    results = []
    for requested in requests:
        torch.set_num_threads(2 + rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = set_intra_op_threads(requested, dist.group.WORLD, torch.device("cpu"))
        results.append((returned, torch.get_num_threads(), [str(w.message) for w in caught]))
    return results


def _message(rank: int, old: int, new: int, requested: int | None) -> str:
    rule = ": the smallest count of any rank" if requested is None else ""
    return (
        f"rank {rank}: torch intra-op threads {old} -> {new} "
        f"(`ReliabilityConfig(intra_op_threads={requested})`{rule}; one count on every rank "
        "keeps TP-replicated parameters bitwise identical)."
    )


def test_every_rank_takes_one_count_and_each_changed_rank_warns():
    """None: the smallest (2, rank 1 changes); 1: both change; 3: rank 0 changes."""
    ranks = run_on_ranks(_agree, 2, [None, 1, 3], emulate_cuda=False)
    smallest, one, three = zip(*ranks, strict=True)
    assert smallest == ((2, 2, []), (2, 2, [_message(1, 3, 2, None)]))
    assert one == ((1, 1, [_message(0, 2, 1, 1)]), (1, 1, [_message(1, 3, 1, 1)]))
    assert three == ((3, 3, [_message(0, 2, 3, 3)]), (3, 3, []))
