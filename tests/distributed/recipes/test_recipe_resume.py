"""Exact mid-epoch resume of the SFT, DPO and reward-model recipes at TP=2: a new Trainer resumed
from the step-2 checkpoint repeats steps 3-4 of the uninterrupted run bitwise (the loaders are
``ResumableLoader``s and DPO's reference is regenerated from the seed)."""

from __future__ import annotations

from _recipe_runs import resume_runs

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 4
TIMINGS = ("step_time", "tokens_per_sec", "samples_per_sec")


def _values(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def test_recipes_resume_exactly_from_a_mid_epoch_checkpoint(tmp_path):
    names = ["sft", "dpo", "rm"]
    rank0, rank1 = run_on_ranks(resume_runs, 2, str(tmp_path), names, STEPS, timeout=240)
    for name in names:
        full, resumed = rank0[name]
        assert len(full.rows) == STEPS and len(resumed.rows) == STEPS - 2, name
        assert "train_loss" in resumed.rows[0] and "grad_norm" in resumed.rows[0]
        # every logged value but the timings, bitwise
        assert _values(resumed.rows) == _values(full.rows[2:]), name
        assert _values(rank1[name][1].rows) == _values(resumed.rows), name
