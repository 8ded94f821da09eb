"""``MCoreRLStrategy(microbatching=MicrobatchConfig(max_tokens_per_microbatch=...))`` under a
Trainer: the ``loss_fn`` path (ClippedPG, variable-length rows) with token-budget microbatches
trains exactly like fixed-size microbatches: the same per-step ``train_loss``, logged loss metrics
and grad norms, and ``compute_logprobs`` in the input sample order (fp32, within 1e-5), padded and
packed at DP=2 (short rows on rank 0, long rows on rank 1: their own plans would need 1 and 2
microbatches, the balanced plan runs 2 on both) and packed at PP=2 (1F1B: one packed length for all
microbatches).

Measured max |budget - fixed| over 3 steps (CPU, printed with ``pytest -s``): DP=2 padded
metrics 7.2e-7, grad norms 1.5e-7, logprobs 9.5e-7; DP=2 packed 4.8e-7 / 5.3e-7 / 9.5e-7; PP=2
packed 7.2e-7 / 1.7e-7 / 9.5e-7."""

from __future__ import annotations

from dataclasses import replace

from _strategy_budget_runs import BudgetResult, SkewedRows, budget_rank
from _strategy_packing_runs import max_run_diffs
from helpers.distributed import RunSpec

from lightning_mcore_rl.data import plan_token_budget_microbatches
from lightning_mcore_rl.testing import run_on_ranks

ATOL = 1e-5
STEPS = 3
BUDGET = 32
SPEC = RunSpec(steps=STEPS, rows=24, global_batch=8, mbs=1)


def _check(results: list[BudgetResult], layouts: tuple[str, ...], fixed_count: int) -> list[int]:
    """Compare every layout's budget run with its fixed run; return the budget run's counts."""
    counts = results[0].budget[layouts[0]].num_microbatches
    for rank, r in enumerate(results):
        for layout in layouts:
            fixed, budget = r.fixed[layout], r.budget[layout]
            expected = ["thd"] if layout == "packed" else ["sbhd"]
            assert fixed.attention_layouts == budget.attention_layouts == expected
            # The budget was used: other microbatch counts than the fixed micro_batch_size=1 run.
            assert fixed.num_microbatches == [fixed_count] * STEPS
            assert all(1 < c < fixed_count for c in budget.num_microbatches), budget
            diffs = max_run_diffs(budget, fixed)
            print(f"{layouts} rank {rank} {layout}: max |budget - fixed| {diffs}")
            assert max(diffs.values()) <= ATOL, diffs
            losses = [m["train_loss"] for m in budget.metrics]
            assert len(set(losses)) == STEPS  # it trains
        assert "ValueError" in r.error and "`max_tokens_per_microbatch`=5" in r.error
        assert "longest sequence (" in r.error
    for layout in layouts:
        assert results[0].budget[layout].metrics == results[1].budget[layout].metrics
    return counts


def test_token_budget_matches_fixed_microbatches_dp2():
    # Without balancing rank 0 (short rows) would run 1 microbatch per step, rank 1 (long) 2.
    rows = SkewedRows(SPEC.rows)
    for rank, want in ((0, 1), (1, 2)):
        for step in range(STEPS):
            lengths = rows.lengths[rank::2][step * 4 : (step + 1) * 4].tolist()
            for packed in (True, False):
                plan = plan_token_budget_microbatches(lengths, BUDGET, packed=packed)
                assert plan.num_microbatches == want, (rank, step, packed, lengths)
    results = run_on_ranks(budget_rank, 2, SPEC, BUDGET, ("padded", "packed"), timeout=120)
    _check(results, ("padded", "packed"), fixed_count=4)
    for r in results:  # balanced: both ranks run rank 1's 2 microbatches
        for layout in ("padded", "packed"):
            assert r.budget[layout].num_microbatches == [2] * STEPS


def test_token_budget_matches_fixed_microbatches_pp2():
    # DP=1: each pipeline rank holds all 8 rows of a step (4 short + 4 long).
    results = run_on_ranks(budget_rank, 2, replace(SPEC, pp=2), 40, ("packed",), timeout=120)
    counts = _check(results, ("packed",), fixed_count=8)
    assert results[1].budget["packed"].num_microbatches == counts
