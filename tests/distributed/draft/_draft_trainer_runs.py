"""Rank function of the draft Trainer tests: the SFT recipe (tiny GPT, the counting task) with and
without an EAGLE draft from ``build_draft_model``, every step's logged metrics and the draft's
grad norm recorded."""

from __future__ import annotations

from typing import Any

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.models.draft_model import eagle_draft
from lightning_mcore_rl.models.eagle3 import eagle3_draft, save_eagle3
from lightning_mcore_rl.parallel import unwrap_model
from lightning_mcore_rl.recipes import SFTDataModule, SFTModule
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state

DATA_STEPS = 40
"""The dataset of every run (the same rows whatever ``steps``)."""


class DraftSFT(SFTModule):
    """SFT with a draft reading the policy's last decoder layer (layer 1 of 2)."""

    def build_draft_model(self) -> torch.nn.Module | None:
        assert self.chunks is not None
        config = unwrap_model(self.chunks[-1]).config
        return eagle_draft(config, vocab_size=16, aux_layers=(1,), groups=self.parallel_groups)


class Eagle3SFT(SFTModule):
    """SFT with an EAGLE-3 draft (the exportable architecture) reading decoder layers 0 and 1."""

    def build_draft_model(self) -> torch.nn.Module | None:
        assert self.chunks is not None
        config = unwrap_model(self.chunks[-1]).config
        return eagle3_draft(config, vocab_size=16, aux_layers=(0, 1), groups=self.parallel_groups)


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        row = {k: float(v) for k, v in trainer.callback_metrics.items()}
        norm = trainer.strategy.draft.last_grad_norm
        row["draft_grad_norm"] = float("nan") if norm is None else norm
        self.rows.append(row)


def sft_rows(
    draft: bool,
    steps: int,
    tp: int = 1,
    pp: int = 1,
    root: str | None = None,
    ckpt_path: str | None = None,
) -> list[dict[str, float]]:
    """``steps`` SFT steps (16 rows per step, 8-row microbatches); with ``root`` a checkpoint
    every 2 steps (``{root}/step=<n>.ckpt``), resumed from ``ckpt_path`` when given."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    record = _Record()
    callbacks: list[Callback] = [record]
    if root is not None and ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=2,
                                         save_top_k=-1))  # fmt: skip
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        microbatching=MicrobatchConfig(micro_batch_size=8),
    )
    trainer = cpu_trainer(
        strategy=strategy, max_steps=steps, gradient_clip_val=1.0, num_sanity_val_steps=0,
        callbacks=callbacks, default_root_dir=root, enable_checkpointing=root is not None,
    )  # fmt: skip
    module = DraftSFT() if draft else SFTModule()
    trainer.fit(module, datamodule=SFTDataModule(num_steps=DATA_STEPS), ckpt_path=ckpt_path)
    destroy_megatron_state()
    return record.rows


def with_and_without(rank: int, steps: int) -> dict[str, list[dict[str, float]]]:
    """TP=1: the recipe with a draft and without."""
    return {"draft": sft_rows(True, steps), "plain": sft_rows(False, steps)}


def layouts(rank: int, steps: int) -> dict[str, list[dict[str, float]]]:
    """TP=2 and PP=2 with a draft."""
    return {"tp2": sft_rows(True, steps, tp=2), "pp2": sft_rows(True, steps, pp=2)}


def resumed(rank: int, root: str, steps: int) -> tuple[list[dict[str, float]], ...]:
    """PP=2: ``steps`` steps saving every 2, then a new Trainer resumed from ``step=2.ckpt``."""
    full = sft_rows(True, steps, pp=2, root=root)
    again = sft_rows(True, steps, pp=2, root=root, ckpt_path=f"{root}/step=2.ckpt")
    return full, again


def eagle3_export(rank: int, directory: str, steps: int, tp: int) -> list[dict[str, float]]:
    """``steps`` SFT steps with :class:`Eagle3SFT` at ``tp``, then the trained draft exported to
    ``directory`` (the draft's TP ranks take part, TP rank 0 writes)."""
    record = _Record()
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=tp, microbatching=MicrobatchConfig(micro_batch_size=8)
    )
    trainer = cpu_trainer(
        strategy=strategy, max_steps=steps, gradient_clip_val=1.0, num_sanity_val_steps=0,
        callbacks=[record],
    )  # fmt: skip
    trainer.fit(Eagle3SFT(), datamodule=SFTDataModule(num_steps=DATA_STEPS))
    draft = trainer.strategy.draft.model
    if draft is not None:
        save_eagle3(draft, directory, groups=trainer.strategy.groups)
    destroy_megatron_state()
    return record.rows


def initial_eagle3_export(rank: int, directory: str) -> None:
    """The untrained :class:`Eagle3SFT` draft (the recipe's default tiny GPT config: 2 layers,
    H = 64, 4 heads, V = 16; seed 0), exported to ``directory``."""
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    draft = eagle3_draft(tiny_gpt_config(), vocab_size=16, aux_layers=(0, 1))
    save_eagle3(draft, directory)
    destroy_megatron_state()
