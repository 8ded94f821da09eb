"""Rank function of the setup-time batch checks: each recipe is fitted with a
``micro_batch_size`` that does not divide its local batch; the error must come from the module's
``setup`` hook, before any batch (rollout, forward) starts."""

from __future__ import annotations

from typing import Any

from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import (
    DistillationModule,
    DPOModule,
    GRPOModule,
    PreferenceDataModule,
    PromptDataModule,
    SFTDataModule,
    SFTModule,
)
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state

CASES: dict[str, tuple[int, Any, Any]] = {
    # name: (micro_batch_size, module factory, datamodule factory), DP = 2
    "grpo": (8, GRPOModule, lambda: PromptDataModule(prompts_per_step=6, num_steps=1)),
    "grpo_dp": (4, GRPOModule, lambda: PromptDataModule(prompts_per_step=5, num_steps=1)),
    "distill": (8, DistillationModule, lambda: PromptDataModule(prompts_per_step=6, num_steps=1)),
    "dpo": (4, DPOModule, lambda: PreferenceDataModule(pairs_per_step=6, num_steps=1)),
    "sft": (4, SFTModule, lambda: SFTDataModule(samples_per_step=6, num_steps=1)),
}


class _Batches(Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.started += 1


def misfit_micro_batches(rank: int) -> dict[str, tuple[str, int]]:
    """``{case: (the ValueError's message, batches started)}`` on this rank."""
    out: dict[str, tuple[str, int]] = {}
    for name, (micro_batch_size, module, data) in CASES.items():
        batches = _Batches()
        trainer = cpu_trainer(
            strategy=MCoreRLStrategy(
                microbatching=MicrobatchConfig(micro_batch_size=micro_batch_size)
            ),
            max_steps=1,
            num_sanity_val_steps=0,
            callbacks=[batches],
        )
        try:
            trainer.fit(module(), datamodule=data())
            message = "no error"
        except ValueError as error:
            message = str(error)
        destroy_megatron_state()
        out[name] = (message, batches.started)
    return out
