"""Rank function of the HF GRPO tests: ``lmrl fit`` with a shipped GRPO YAML (``grpo_hf.yaml``:
TP=2, reference KL on; ``grpo_moe_tiny.yaml``: EP=2) on a tiny random Hugging Face model, a few
steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

CONFIGS = Path(__file__).parents[3] / "examples" / "configs"


class Rows(Callback):
    """Every step's logged metrics, as floats."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def lmrl_fit(
    rank: int,
    hf_dir: str,
    root: str,
    steps: int,
    config: str = "grpo_hf.yaml",
    overrides: tuple[str, ...] = (),
) -> list[dict[str, float]]:
    """``lmrl fit --config examples/configs/<config> --model.init_args.model.path=... <overrides>``."""
    from lightning_mcore_rl.cli import build_cli

    cli = build_cli(
        [
            "--config", str(CONFIGS / config),
            f"--model.init_args.model.path={hf_dir}",
            f"--trainer.max_steps={steps}",
            f"--data.init_args.num_steps={steps}",
            "--data.init_args.prompts_per_step=4",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={root}",
            *overrides,
        ],
        run=False,
    )  # fmt: skip
    rows = Rows()
    cli.trainer.callbacks.append(rows)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return rows.rows
