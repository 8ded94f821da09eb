"""``HFExport`` refuses, at ``setup`` (before any collective), a module without a Hugging Face
bridge: one without a recipe ``policy``, a recipe of the tiny GPT, and a reward model (whose
score head has no causal-LM counterpart)."""

from __future__ import annotations

import pytest
from lightning.pytorch import LightningModule

from lightning_mcore_rl.callbacks import HFExport
from lightning_mcore_rl.recipes import SFTModule


def test_setup_needs_an_hf_bridge(tmp_path):
    callback = HFExport(tmp_path / "out")
    with pytest.raises(TypeError, match="needs a recipe module with a `policy`.*LightningModule"):
        callback.setup(None, LightningModule(), "fit")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match="SFTModule's model has no Hugging Face bridge.*TinyGPTSpec"
    ):
        callback.setup(None, SFTModule(), "fit")  # type: ignore[arg-type]


def test_setup_refuses_a_reward_model(tmp_path):
    from lightning_mcore_rl.recipes import HFModelSpec, RewardModelModule

    module = RewardModelModule(model=HFModelSpec(path=str(tmp_path)))  # has an HF bridge
    with pytest.raises(TypeError, match=r"HFExport writes causal LMs; a RewardModelModule"):
        HFExport(tmp_path).setup(None, module, "fit")  # type: ignore[arg-type]
