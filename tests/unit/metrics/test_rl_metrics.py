"""pass@k, the standard deviation and the rule reduction against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mcore_rl.losses import REDUCTION_RULES
from lightning_mcore_rl.metrics import (
    AGGREGATIONS,
    PassAtK,
    RuleReduction,
    StandardDeviation,
    combine_rows,
    pass_at_k,
)


def test_pass_at_k_hand_values():
    # pass@k = 1 - C(n-c, k) / C(n, k), n = 4 samples:
    # c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25;  c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    # c=0: 0 for any k;  c=2, k=2: 1 - C(2,2)/C(4,2) = 5/6;  c=3, k=2: 1 - C(1,2)/C(4,2) = 1
    c = torch.tensor([1, 0, 2, 3, 4])
    assert pass_at_k(4, c, 1).tolist() == pytest.approx([0.25, 0.0, 0.5, 0.75, 1.0], abs=1e-15)
    assert pass_at_k(4, c, 2).tolist() == pytest.approx([0.5, 0.0, 5 / 6, 1.0, 1.0], abs=1e-15)
    assert pass_at_k(4, c, 4).tolist() == pytest.approx([1.0, 0.0, 1.0, 1.0, 1.0], abs=1e-15)


def test_pass_at_k_metric_averages_problems_and_rejects_bad_input():
    metric = PassAtK(2)
    metric.update(torch.tensor([[True, False, False, False], [False] * 4]))  # 0.5, 0
    metric.update(torch.tensor([[True, True, False, False]]))  # 5/6
    assert float(metric.compute()) == pytest.approx((0.5 + 0.0 + 5 / 6) / 3, abs=1e-15)
    with pytest.raises(ValueError, match=r"`k` must be in \[1, n=4\], got 5"):
        PassAtK(5).update(torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="`k` must be a positive int, got 0"):
        PassAtK(0)
    with pytest.raises(ValueError, match=r"`correct` must be \[problems, samples\]"):
        PassAtK(1).update(torch.zeros(4, dtype=torch.bool))


def test_standard_deviation_is_the_population_std():
    metric = StandardDeviation()
    values = torch.tensor([0.0, 0.25, 1.0, 1.0, 0.5])
    metric.update(values[:2])
    metric.update(values[2:])
    # mean 0.55, E[x^2] = (0 + 0.0625 + 1 + 1 + 0.25) / 5 = 0.4625, var = 0.4625 - 0.3025 = 0.16
    assert float(metric.compute()) == pytest.approx(0.4, abs=1e-12)
    assert float(StandardDeviation().compute()) == 0.0


def test_rule_reduction_combines_each_entry_by_its_rule():
    metric = RuleReduction(["sum", "min", "max"], sync=False)
    assert metric.compute().tolist() == [0.0, math.inf, -math.inf]  # identities
    metric.update(torch.tensor([1.0, 2.0, 3.0]))
    metric.update(torch.tensor([0.5, -1.0, 1.0]))
    assert metric.compute().tolist() == [1.5, -1.0, 3.0]
    with pytest.raises(ValueError, match=r"`values` must have shape \(3,\)"):
        metric.update(torch.zeros(2))


def test_combine_rows_reduces_each_column_by_its_rule():
    rows = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 1.0], [0.25, 4.0, -2.0]], dtype=torch.float64)
    assert combine_rows(rows, ["sum", "min", "max"]).tolist() == [1.75, -1.0, 3.0]
    assert combine_rows(rows[:1], ["max", "sum", "min"]).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"`rows` must have shape \[R, 2\], got \(3, 3\)"):
        combine_rows(rows, ["sum", "min"])


def test_every_rule_has_a_torchmetrics_aggregation():
    for rule in REDUCTION_RULES.values():
        assert rule.combine in AGGREGATIONS and rule.across_batches in AGGREGATIONS
