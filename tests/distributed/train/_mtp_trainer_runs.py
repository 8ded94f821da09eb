"""Rank function of the MTP Trainer test: the SFT recipe on the tiny GPT with and without
``TinyGPTSpec(mtp_num_layers=1)``, every step's logged metrics recorded."""

from __future__ import annotations

from typing import Any

from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import SFTDataModule, SFTModule, TinyGPTSpec
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state

DATA_STEPS = 20
"""The dataset of every run (the same rows whatever `steps`)."""


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def sft_rows(mtp_num_layers: int, steps: int, tp: int = 1) -> list[dict[str, float]]:
    """``steps`` SFT steps (16 rows of the counting task per step, 8-row microbatches)."""
    record = _Record()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(tensor_model_parallel_size=tp,
                                 microbatching=MicrobatchConfig(micro_batch_size=8)),
        max_steps=steps, gradient_clip_val=1.0, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    module = SFTModule(model=TinyGPTSpec(mtp_num_layers=mtp_num_layers))
    trainer.fit(module, datamodule=SFTDataModule(num_steps=DATA_STEPS))
    destroy_megatron_state()
    return record.rows


def with_and_without(rank: int, steps: int) -> dict[str, list[dict[str, float]]]:
    """The recipe with one MTP layer and without (TP=1)."""
    return {"mtp": sft_rows(1, steps), "plain": sft_rows(0, 1)}


def tensor_parallel(rank: int, steps: int) -> list[dict[str, float]]:
    """The recipe with one MTP layer at TP=2."""
    return sft_rows(1, steps, tp=2)
