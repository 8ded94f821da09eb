"""One training run of the tiny GPT under ``MCoreRLStrategy``, launched by Lightning's local
launcher, ``torchrun`` or SLURM-style environment variables (``test_launch.py``).

Usage: ``python _train_script.py OUT_DIR --devices N --num-nodes M [--tp T]``

Every rank writes ``OUT_DIR/rank{global_rank}.json`` (its ranks as Lightning and megatron see
them, per-step ``train_loss`` and grad norm, the cluster environment's class, torch's intra-op
thread count); rank 0 alone prints
``RANK_ZERO_MARKER`` (through ``rank_zero_only``); every rank prints a line once its imports are
done and one per step (the launch test's progress signal); ``ModelCheckpoint`` writes one
``*.ckpt`` directory under ``OUT_DIR/ckpt`` and ``CSVLogger`` a ``metrics.csv`` under
``OUT_DIR/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig

VOCAB = 128
SEQ = 16
STEPS = 3
GLOBAL_BATCH = 4
MARKER = "RANK_ZERO_MARKER"


class TokenRows(Dataset):
    """Deterministic LM samples ``{"tokens": [S], "labels": [S]}``."""

    def __init__(self, num_rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {"tokens": row[:-1], "labels": row[1:]}


class TinyGPT(MCoreRLModule):
    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, num_layers=2)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)


class Recorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        step = cast("MCoreRLStrategy", trainer.strategy).last_optimizer_step
        assert step is not None and step.grad_norm is not None
        self.grad_norms.append(float(step.grad_norm))
        print(f"rank {trainer.global_rank}: step {trainer.global_step} done", flush=True)


@rank_zero_only
def print_marker() -> None:
    print(MARKER, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    print(f"started: {args}", flush=True)  # progress: the imports are done

    recorder = Recorder()
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=args.tp, microbatching=MicrobatchConfig(micro_batch_size=2)
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        logger=CSVLogger(args.out / "logs", name="", version=""),
        callbacks=[
            recorder,
            ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=STEPS),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    dp = args.devices * args.num_nodes // args.tp
    loader = DataLoader(TokenRows(GLOBAL_BATCH * STEPS), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(TinyGPT(), loader)
    print_marker()
    groups = strategy.groups
    result = {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "tp_rank": groups.tp_rank,
        "dp_rank": groups.dp_rank,
        "environment": type(strategy.cluster_environment).__name__,
        "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "global_step": trainer.global_step,
        "threads": torch.get_num_threads(),
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
