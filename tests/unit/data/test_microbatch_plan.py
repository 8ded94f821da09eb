"""Token-budget microbatch planning (single process) and order restoration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mcore_rl.data import (
    MicrobatchPlan,
    TokenBudgetMicrobatches,
    microbatch_cost,
    plan_token_budget_microbatches,
)


def test_costs() -> None:
    assert microbatch_cost([3, 5], packed=True, pad_individual=4) == 4 + 8
    assert microbatch_cost([3, 5], packed=False, pad_individual=4) == 2 * 8
    assert microbatch_cost([], packed=True) == 0


def test_first_fit_decreasing_hand_case() -> None:
    # sorted: 7(i1), 5(i3), 4(i0), 3(i2), 1(i4); budget 8 -> [7,1], [5,3], [4]
    plan = plan_token_budget_microbatches([4, 7, 3, 5, 1], 8)
    assert plan.indices == ((1, 4), (2, 3), (0,))
    assert plan.costs == (8, 8, 4)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 64), min_size=1, max_size=24),
    slack=st.integers(0, 100),
    packed=st.booleans(),
    pad=st.sampled_from([1, 4]),
    extra=st.integers(0, 8),
)
def test_property_budget_and_coverage(
    lengths: list[int], slack: int, packed: bool, pad: int, extra: int
) -> None:
    budget = max(-(-max(lengths) // pad) * pad, 1) + slack
    minimum = min(len(lengths), 1 + extra)
    plan = plan_token_budget_microbatches(
        lengths, budget, packed=packed, pad_individual=pad, min_num_microbatches=minimum
    )
    assert plan.num_microbatches >= minimum
    assert all(cost <= budget for cost in plan.costs)
    assert sorted(i for index in plan.indices for i in index) == list(range(len(lengths)))
    assert all(len(index) >= 1 for index in plan.indices)


def test_restore_order_pads_and_reorders() -> None:
    plan = MicrobatchPlan(indices=((1, 2), (0,)), costs=(0, 0))
    holder = TokenBudgetMicrobatches(microbatches=[], plan=plan, width=3)
    outputs = [torch.tensor([[1.0, 1.5], [2.0, 2.5]]), torch.tensor([[0.0, 0.5, 0.75]])]
    restored = holder.restore_order(outputs, pad_value=-1.0)
    assert restored.tolist() == [[0.0, 0.5, 0.75], [1.0, 1.5, -1.0], [2.0, 2.5, -1.0]]
    assert holder.restore_order([torch.tensor([1, 2]), torch.tensor([0])]).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"got 1 outputs for 2 microbatches"):
        holder.restore_order(outputs[:1])
    with pytest.raises(ValueError, match=r"an output has 1 rows but its microbatch holds 2"):
        holder.restore_order([outputs[1], outputs[0]])


def test_plan_errors() -> None:
    with pytest.raises(
        ValueError, match=r"`max_tokens_per_microbatch`=6 is smaller than the longest"
    ):
        plan_token_budget_microbatches([3, 7], 6)
    with pytest.raises(ValueError, match=r"longest sequence \(7 tokens, 8 after padding to 4\)"):
        plan_token_budget_microbatches([3, 7], 7, pad_individual=4)
    with pytest.raises(ValueError, match=r"`min_num_microbatches`=3 must be in \[1, 2\]"):
        plan_token_budget_microbatches([3, 7], 100, min_num_microbatches=3)
    with pytest.raises(ValueError, match=r"empty batch"):
        plan_token_budget_microbatches([], 100)
