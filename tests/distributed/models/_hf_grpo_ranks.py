"""Rank function of the HF GRPO test: ``lmrl fit`` with the shipped ``grpo_hf.yaml`` on a tiny
random Hugging Face model (TP=2, reference KL on), a few steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

CONFIG = Path(__file__).parents[3] / "examples" / "configs" / "grpo_hf.yaml"


class Rows(Callback):
    """Every step's logged metrics, as floats."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def lmrl_fit(rank: int, hf_dir: str, root: str, steps: int) -> list[dict[str, float]]:
    """``lmrl fit --config examples/configs/grpo_hf.yaml --model.init_args.model.path=...``."""
    from lightning_mcore_rl.cli import build_cli

    cli = build_cli(
        [
            "--config", str(CONFIG),
            f"--model.init_args.model.path={hf_dir}",
            f"--trainer.max_steps={steps}",
            f"--data.init_args.num_steps={steps}",
            "--data.init_args.prompts_per_step=4",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={root}",
        ],
        run=False,
    )  # fmt: skip
    rows = Rows()
    cli.trainer.callbacks.append(rows)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return rows.rows
