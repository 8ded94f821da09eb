"""``Trainer.validate`` of the SFT, DPO and reward-model recipes at DP=2 (one held-out global
batch, half on each rank): the initial model's ``val_loss`` (and the reward model's
``val_accuracy``) equal plain torch on the whole held-out set; DPO's is ln 2 with accuracy 0."""

from __future__ import annotations

import pytest
from _recipe_runs import validate_initial

from lightning_mcore_rl.testing import run_on_ranks


def test_recipe_validation_equals_plain_torch_on_the_held_out_set():
    rank0, rank1 = run_on_ranks(validate_initial, 2, timeout=240)
    for name, (logged, (loss, accuracy)) in rank0.items():
        assert logged == rank1[name][0], name  # identical on both DP ranks
        print(name, logged["val_loss"], loss)
        assert logged["val_loss"] == pytest.approx(loss, abs=1e-5), name
        if name != "sft":
            assert logged["val_accuracy"] == pytest.approx(accuracy, abs=1e-6), name
