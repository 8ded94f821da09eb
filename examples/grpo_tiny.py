"""GRPO on CPU: a tiny megatron-core GPT learns to count modulo 4 on two CPU ranks.

Launch: ``scripts/run_example.sh`` (= ``.venv/bin/python examples/grpo_tiny.py``); Lightning
starts the second rank itself. The same run from YAML: ``lmrl fit --config
examples/configs/grpo_tiny.yaml``.

The policy must continue each prompt by counting modulo 4 (each token one more than the previous):
the reward starts near 0.25 (a random policy) and passes 0.95 within about 40 steps.
Writes ``outputs/grpo_tiny/metrics.csv`` (every logged metric per optimizer step) and
``metrics.png`` (two panels: reward and grad norm per step) next to Lightning's CSV logs.
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.callbacks import MetricsHistory
from lightning_mcore_rl.rank_errors import install_rank_excepthook
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule
from lightning_mcore_rl.strategy import MicrobatchConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2, help="TP size (DP = 2/TP)")
    parser.add_argument("--output", default="outputs/grpo_tiny")
    args = parser.parse_args()
    install_rank_excepthook()  # an error on both ranks: one traceback (rank 0's), as under lmrl

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=args.tp, microbatching=MicrobatchConfig(micro_batch_size=16)
        ),
        max_steps=args.steps,  # epochs unbounded: max_steps alone ends the run
        gradient_clip_val=1.0,
        logger=CSVLogger(args.output, name="logs"),
        callbacks=[
            TQDMProgressBar(),  # "Epoch 0"; rich's bar reads "Epoch 0/-2" without max_epochs
            MetricsHistory(args.output, plot_keys=("reward", "grad_norm")),
        ],
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    trainer.fit(GRPOModule(), datamodule=PromptDataModule(num_steps=args.steps))
    if trainer.is_global_zero:
        print(f"metrics: {args.output}/metrics.csv, plot: {args.output}/metrics.png")


if __name__ == "__main__":
    main()
