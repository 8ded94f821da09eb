"""Rank function of the ``export_checkpoint`` test: a short ``Trainer.fit`` of an HF-imported
model with ``MCoreRLStrategy(tensor_model_parallel_size=2)``, then a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _hf_ranks import SEQ, VOCAB, input_ids
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.models import HFBridge
from lightning_mcore_rl.strategy import MicrobatchConfig


class _Rows(Dataset):
    """Four LM samples ``{"tokens": [SEQ], "labels": [SEQ]}``: one global batch, the same every
    step (so the loss must fall)."""

    def __init__(self) -> None:
        self.rows = torch.randint(
            0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5)
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[index, :-1], "labels": self.rows[index, 1:]}


class HFModule(MCoreRLModule):
    """Builds its chunks with :class:`HFBridge`; Adam at lr 1e-3."""

    def __init__(self, hf_dir: str) -> None:
        super().__init__()
        self.hf_dir = hf_dir

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        bridge = HFBridge.from_pretrained(self.hf_dir)
        config = self.transformer_config(**bridge.config_fields())
        return bridge.build_chunk(config, vp_stage, groups=self.parallel_groups)

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3)


class _Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def fit_and_checkpoint(rank: int, hf_dir: str, ckpt: str) -> dict[str, Any]:
    """Train 6 steps at TP=2 on one repeated global batch, save ``ckpt``; return the per-step
    losses and the trained model's TP-gathered logits on :func:`input_ids` (rank 0)."""
    from megatron.core import parallel_state as ps

    module = HFModule(hf_dir)
    losses = _Losses()
    trainer = cpu_trainer(
        devices=2,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=2)
        ),
        max_steps=6,
        callbacks=[losses],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DataLoader(_Rows(), batch_size=4))
    trainer.save_checkpoint(Path(ckpt))
    (chunk,) = module.chunks
    ids = input_ids()
    with torch.no_grad():
        logits = chunk(ids, torch.arange(SEQ).expand_as(ids), None).contiguous()
    parts = [torch.empty_like(logits) for _ in range(2)]
    torch.distributed.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
    return {"logits": torch.cat(parts, dim=-1) if rank == 0 else None, "losses": losses.values}
