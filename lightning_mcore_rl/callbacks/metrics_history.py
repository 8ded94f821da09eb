"""Record logged metrics every optimizer step and write them as CSV (+ a PNG plot) at the end."""

from __future__ import annotations

import csv
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

PLOT_EXTRA_HINT = "pip install lightning-mcore-rl[plot]"


class MetricsHistory(Callback):
    """Keeps the scalar `trainer.callback_metrics` of every training step (one row per logger
    step) and, on rank 0 when `fit` ends or fails, writes `<directory>/metrics.csv` and, with
    matplotlib (the `plot` extra), `<directory>/metrics.png`. Works with any `LightningModule`.

    Args:
        directory: output folder (created).
        plot_keys: metrics to plot; the CSV holds every logged scalar metric.
        val_prefixes: name prefixes of validation metrics.
    """

    def __init__(
        self,
        directory: str | Path,
        plot_keys: tuple[str, ...] = ("reward", "train_loss"),
        val_prefixes: tuple[str, ...] = ("val_", "val/"),
    ):
        self.directory = Path(directory)
        self.plot_keys = tuple(plot_keys)
        self.val_prefixes = tuple(val_prefixes)
        self._rows: dict[int, dict[str, float]] = {}
        self._written: list[dict[str, float]] | None = None
        self._warned_no_matplotlib = False

    @property
    def rows(self) -> list[dict[str, float]]:
        """The recorded rows in step order (``step`` first)."""
        return [self._rows[step] for step in sorted(self._rows)]

    # ---------------------------------------------------------------- hooks

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # under MCoreRLStrategy, TrainingStatistics runs first and put this step's values there
        # (all but its timing metrics, which go to the loggers only); an `on_epoch` training
        # metric keeps its last epoch's value
        metrics = _scalars(trainer.callback_metrics)
        # gradient accumulation: the step's batches share (and update) one row
        self._row(trainer).update({k: v for k, v in metrics.items() if not self._is_val(k)})

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        # validation metrics go only to the row of the step after which validation ran, so no
        # row repeats a stale validation value
        metrics = _scalars(trainer.callback_metrics)
        self._row(trainer).update({k: v for k, v in metrics.items() if self._is_val(k)})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.write()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if trainer.is_global_zero:
            self.write()

    def state_dict(self) -> dict[str, Any]:
        """The rows so far, saved in each checkpoint."""
        # so a resumed run writes the whole history, not only the resumed steps
        return {"rows": self.rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the rows of the run a checkpoint was saved in."""
        self._rows = {int(row["step"]): dict(row) for row in state_dict["rows"]}

    # ---------------------------------------------------------------- output

    def write(self) -> None:
        """Write `metrics.csv` (and `metrics.png`) for the rows so far, unless none is new."""
        rows = self.rows
        if not rows or rows == self._written:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for row in rows for k in row}, key=lambda k: (k != "step", k))
        with open(self.directory / "metrics.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        self._written = [dict(row) for row in rows]
        self._plot(rows)

    def _plot(self, rows: list[dict[str, float]]) -> None:
        keys = [k for k in self.plot_keys if any(k in row for row in rows)]
        if not keys:
            return
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            if not self._warned_no_matplotlib:
                self._warned_no_matplotlib = True
                warnings.warn(
                    f"MetricsHistory: matplotlib is not installed, so {self.directory}/metrics.png "
                    f"is not plotted (metrics.csv is written). Install the `plot` extra: "
                    f"`{PLOT_EXTRA_HINT}`.",
                    UserWarning,
                    stacklevel=2,
                )
            return
        fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            points = [(row["step"], row[key]) for row in rows if key in row]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.directory / "metrics.png", dpi=100)
        plt.close(fig)

    # ---------------------------------------------------------------- helpers

    def _is_val(self, key: str) -> bool:
        return key.startswith(self.val_prefixes)

    def _row(self, trainer: Trainer) -> dict[str, float]:
        step = _logger_step(trainer)
        return self._rows.setdefault(step, {"step": step})


def _logger_step(trainer: Trainer) -> int:
    """The step index Lightning's loggers give the current training step (0-based)."""
    # `global_step` already counts this step's optimizer step from its `on_train_batch_end` to
    # the end of the validation run after it
    return max(trainer.global_step - 1, 0)


def _scalars(metrics: Mapping[str, Tensor]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v.numel() == 1}
