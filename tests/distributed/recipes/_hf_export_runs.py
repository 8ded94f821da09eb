"""Rank function of the ``HFExport`` tests: a short SFT of a tiny HF model (the arithmetic
example's Llama at TP=2, a Qwen3-MoE at EP=2; ``ResponseFileDataModule`` rows) with
``HFExport``, then the trained policy's logprobs of the first batch, computed by megatron right
after the export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.callbacks import HFExport
from lightning_mcore_rl.recipes import HFModelSpec, ResponseFileDataModule, SFTModule
from lightning_mcore_rl.strategy import MicrobatchConfig


class _Probe(Callback):
    """Keeps the first batch and, at the end of training (after ``HFExport``), the trained
    megatron policy's token logprobs ``[B, S]`` of it."""

    def __init__(self) -> None:
        self.batch: dict[str, torch.Tensor] = {}
        self.logprobs = torch.empty(0)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.batch = {k: v.clone() for k, v in batch.items()}

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.logprobs = module.compute_logprobs(self.batch)


def sft_and_export(
    rank: int,
    init_dir: str,
    sft_file: str,
    out_dir: str,
    steps: int,
    layout: tuple[tuple[str, int], ...] = (("tensor_model_parallel_size", 2),),
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``steps`` SFT steps of 8 rows under ``layout`` (``MCoreRLStrategy`` sizes; default TP=2,
    DP=1), exported to ``out_dir``; returns this rank's first batch and the trained policy's
    logprobs of it."""
    probe = _Probe()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            **dict(layout), microbatching=MicrobatchConfig(micro_batch_size=4)
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[HFExport(out_dir), probe],
    )
    vocab = json.loads((Path(init_dir) / "config.json").read_text())["vocab_size"]
    module = SFTModule(HFModelSpec(init_dir), vocab_size=vocab, max_sequence_length=32, lr=1e-2)
    data = ResponseFileDataModule(sft_file, init_dir, samples_per_step=8)
    trainer.fit(module, datamodule=data)
    return probe.batch, probe.logprobs
