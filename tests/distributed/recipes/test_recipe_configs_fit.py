"""``lmrl fit --config examples/configs/<recipe>.yaml --trainer.max_steps 3`` runs each shipped
SFT/DPO/reward-model config on its two ranks and writes its metrics history."""

from __future__ import annotations

import csv
import math

from _recipe_runs import lmrl_fit

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 3


def test_lmrl_fit_runs_the_sft_dpo_and_reward_model_configs(tmp_path):
    names = ["sft_tiny", "dpo_tiny", "rm_tiny"]
    rank0, _ = run_on_ranks(lmrl_fit, 2, str(tmp_path), names, STEPS, timeout=240)
    for name in names:
        rows = list(csv.DictReader(rank0[name]))
        assert [int(row["step"]) for row in rows] == list(range(STEPS)), name
        assert all(math.isfinite(float(row["train_loss"])) for row in rows), name
    dpo = list(csv.DictReader(rank0["dpo_tiny"]))
    assert abs(float(dpo[0]["train_loss"]) - math.log(2)) < 1e-6  # policy = reference at step 0
