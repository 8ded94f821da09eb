"""The SFT recipe under a Trainer: its step-0 loss is the plain-torch NLL of the batch on the
initial weights, the loss falls on the toy task, and TP=2, DP=2 and DP=2 with packed token-budget
microbatches give the TP=1 run's per-step losses."""

from __future__ import annotations

import math

import pytest
from _recipe_runs import Fit, sft_layouts, sft_single_rank

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 20  # the single-rank run (loss check)
LAYOUT_STEPS = 4  # the layout runs, against the single-rank run's first steps


@pytest.fixture(scope="module")
def single() -> tuple[Fit, float]:
    (result,) = run_on_ranks(sft_single_rank, 1, STEPS, timeout=240)
    return result


def test_sft_step0_equals_plain_torch_and_loss_falls(single: tuple[Fit, float]):
    fit, plain = single
    losses = [row["train_loss"] for row in fit.rows]
    assert len(losses) == STEPS
    # 16 rows of 9-16 tokens, 1-8 response tokens each: random weights give ~ln(16) = 2.77
    print(f"step 0: {losses[0]} (plain torch {plain}); step {STEPS - 1}: {losses[-1]}")
    assert losses[0] == pytest.approx(plain, abs=1e-5)
    assert abs(losses[0] - math.log(16)) < 0.2
    assert int(fit.rows[0]["train_num_unmasked_tokens"]) == int(fit.first_batch["token_mask"].sum())
    # the data and the initial weights fix the trajectory: the CPU's rounding moves the losses by
    # ~1e-7 only (AVX2 kernels: ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    # ONEDNN_MAX_CPU_ISA=AVX2). Measured at step 19 over seeds 0 (this test's), 1, 2 (weights and
    # data), default and AVX2 kernels: 0.102-0.131, from 2.74-2.84 at step 0
    assert losses[-1] < 0.2, losses


def test_sft_tp2_dp2_and_packed_token_budget_equal_tp1(single: tuple[Fit, float]):
    fit, _ = single
    results = run_on_ranks(sft_layouts, 2, LAYOUT_STEPS, timeout=240)
    want = [row["train_loss"] for row in fit.rows[:LAYOUT_STEPS]]
    norms = [row["grad_norm"] for row in fit.rows[:LAYOUT_STEPS]]
    for name, run in results[0].items():
        assert run.rows == results[1][name].rows, name  # every logged value equal on both ranks
        got = [row["train_loss"] for row in run.rows]
        print(name, max(abs(a - b) for a, b in zip(got, want, strict=True)))
        assert got == pytest.approx(want, abs=1e-5), name
        assert [row["grad_norm"] for row in run.rows] == pytest.approx(norms, rel=1e-5), name
