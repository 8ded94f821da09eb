"""Record logged metrics every optimizer step and write them as CSV + a PNG plot at the end."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class MetricsHistory(Callback):
    """Keeps ``trainer.callback_metrics`` after every optimizer step and, on rank 0 at the end of
    ``fit``, writes ``<directory>/metrics.csv`` and ``<directory>/metrics.png`` (one panel per
    plotted key; needs matplotlib, the ``plot`` extra).

    Args:
        directory: output folder (created).
        plot_keys: metrics to plot; the CSV holds every logged metric.
    """

    def __init__(
        self, directory: str | Path, plot_keys: tuple[str, ...] = ("reward", "train_loss")
    ):
        self.directory = Path(directory)
        self.plot_keys = plot_keys
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        row = {"step": float(trainer.global_step)}
        row.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
        self.rows.append(row)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.rows:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for row in self.rows for k in row}, key=lambda k: (k != "step", k))
        with open(self.directory / "metrics.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        self._plot()

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = [k for k in self.plot_keys if any(k in row for row in self.rows)]
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            points = [(row["step"], row[key]) for row in self.rows if key in row]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
            ax.set_xlabel("optimizer step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.directory / "metrics.png", dpi=100)
        plt.close(fig)
