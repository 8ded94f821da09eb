"""The GRPO recipe trains a Hugging Face model through ``lmrl fit`` (the shipped
``grpo_hf.yaml``, TP=2 on two ranks, reference-policy KL from the re-read checkpoint)."""

from __future__ import annotations

import math

from _hf_grpo_ranks import lmrl_fit
from _hf_ranks import build_hf_model, hf_configs

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 3


def test_lmrl_fit_trains_an_hf_model_with_grpo(tmp_path):
    source = tmp_path / "llama"
    build_hf_model(hf_configs()["llama"], source, seed=1)
    rank0, rank1 = run_on_ranks(lmrl_fit, 2, str(source), str(tmp_path), STEPS, timeout=240)
    assert rank0 == rank1  # every logged value identical on both TP ranks
    assert len(rank0) == STEPS
    for row in rank0:
        assert math.isfinite(row["train_loss"]) and 0.0 <= row["reward"] <= 1.0
        assert row["grad_norm"] > 0
    # Step 0: the policy IS the reference (the re-read checkpoint), so the KL penalty is 0 up to
    # float noise; after two Adam steps it is not.
    assert abs(rank0[0]["train_kl_penalty"]) < 1e-6
    assert rank0[-1]["train_kl_penalty"] > 1e-6
