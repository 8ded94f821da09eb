"""Under DP=2 every synchronised metric equals the value on the concatenated samples."""

from __future__ import annotations

import pytest
import torch
from _metric_ranks import rank_samples, synced

from lightning_mcore_rl.metrics import pass_at_k
from lightning_mcore_rl.testing import run_on_ranks


def test_synchronised_metrics_equal_the_concatenated_computation():
    results = run_on_ranks(synced, 2, timeout=60)
    assert results[0] == results[1]  # identical on both ranks
    correct = torch.cat([rank_samples(r)[0] for r in range(2)])
    rewards = torch.cat([rank_samples(r)[1] for r in range(2)])
    for k in (1, 2, 3):
        expected = float(pass_at_k(4, correct.sum(dim=1), k).mean())
        assert results[0][f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert results[0]["std"] == pytest.approx(float(rewards.double().std(correction=0)), abs=1e-12)
    assert results[0]["rule"] == [3.0, -1.0, 10.0]  # sum 1+2, min(0,-1), max(0,10)
