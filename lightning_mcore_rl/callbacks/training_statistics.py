"""``TrainingStatistics``: log every step's loss, metrics, grad norm, timing and throughput."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import Metric

if TYPE_CHECKING:
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy
    from lightning_mcore_rl.train import StepOutput

MetricValue = float | torch.Tensor

TIMING_METRICS = ("step_time", "tokens_per_sec", "samples_per_sec")
"""Logged keys that measure wall time (all others are functions of the data and the model)."""


class TrainingStatistics(Callback):
    """Logs each optimizer step's `train_loss`, `train_<metric>`, `grad_norm`, `step_time`,
    `tokens_per_sec`/`samples_per_sec`, response lengths and `skipped_steps` once to
    `trainer.loggers` (every `log_every_n_steps`: set 1), `val_<metric>` through `self.log`, and
    the run's configuration as hyperparameters; this step's values go to `callback_metrics`.

    Args:
        prog_bar: metric names also shown in the progress bar (not the timing metrics).
    """

    # Straight to the loggers (`logger.log_metrics`, as Lightning's `LearningRateMonitor`), not
    # `self.log`: one row per step in CSV/TensorBoard/W&B, no per-key bookkeeping. The step's loss
    # and metrics come from the `StepOutput` its `training_step` returns, already combined by
    # their `MetricNormalizer` rules; the grad norm, the skip and the previous step's time from
    # the strategy's `StepRecord`. `step_time` needs the other ranks' times, which ride on the
    # next step's agreement collective (`reliability/agreement.py:StepBoundary`, no collective
    # of its own), so step N's row reaches the loggers at the end of step N + 1 (the last one at
    # `on_train_end`, after one all-reduce; after an exception without its timing metrics). The
    # timing metrics are float64 (`tokens_per_sec * step_time` gives back the token count), other
    # Python numbers float32, as `self.log` makes them. `MCoreRLModule.configure_callbacks` puts
    # it first, so other callbacks' `on_train_batch_end` see this step's values (with another
    # module, pass it first in `Trainer(callbacks=...)`). Validation metrics aggregate over the
    # epoch by `REDUCTION_RULES`' `across_batches` column.

    def __init__(self, prog_bar: tuple[str, ...] = ("train_loss",)) -> None:
        self.prog_bar = prog_bar
        self._val_metrics: dict[str, Metric] = {}
        self._warned_no_output = False
        self._pending: _Row | None = None  # the last step's row, waiting for its step_time

    # ---------------------------------------------------------------- hooks

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the run configuration as hyperparameters (rank 0's loggers)."""
        config = self.run_config(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_hyperparams(config)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pending = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Publish the step from its `outputs` (the `training_step` result) and log the previous
        step's row, its `step_time` now agreed."""
        record = _strategy(trainer).step_record
        self._log_pending(trainer, record.previous_step_time if record is not None else None)
        output = self._step_output(outputs, "training_step")
        if output is None:
            return
        values = {
            k: _logged_tensor(k, v)
            for k, v in self.step_metrics(trainer, pl_module, output).items()
        }
        # the public dict other callbacks read (Lightning's own multiprocessing launcher updates it
        # the same way); no `self.log` bookkeeping per key
        trainer.callback_metrics.update(values)
        if trainer.progress_bar_callback is not None:
            # the dict the progress bar reads (what `self.log(prog_bar=True)` fills, as a float),
            # updated directly: `self.log` costs ~0.65 ms per key and step
            trainer.progress_bar_metrics.update(
                {k: values[k].item() for k in self.prog_bar if k in values}
            )
        if _logs_step(trainer):
            timed = record is None or not record.skipped
            self._pending = _Row(trainer.global_step - 1, trainer.current_epoch, values,
                                 output if timed else None)  # fmt: skip

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the last step's row, with its ``step_time`` (one all-reduce, every rank)."""
        self._log_pending(trainer, _strategy(trainer).agree_last_step_time())

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Log the last step's row without its timing metrics (no collective here)."""
        self._log_pending(trainer, None)

    def _log_pending(self, trainer: Trainer, step_time: float | None) -> None:
        """Send the pending row to every logger, with the timing metrics of `step_time` (its
        step's slowest wall time; none when `None`)."""
        row, self._pending = self._pending, None
        if row is None or not trainer.loggers:
            return
        values = dict(row.values)
        if row.output is not None and step_time is not None:
            timing = self.timing_metrics(row.output, step_time)
            values.update({k: _logged_tensor(k, v) for k, v in timing.items()})
        metrics = {k: v.item() for k, v in values.items()}
        metrics["epoch"] = row.epoch  # Lightning's loggers get it with every training row
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=row.step)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        from lightning_mcore_rl.losses import MEAN_RULE, REDUCTION_RULES, MetricNormalizer

        output = self._step_output(outputs, None)
        if output is None:
            return
        norms: Mapping[str, Any] = getattr(
            getattr(pl_module, "loss_fn", None), "metric_normalizations", {}
        )
        values = {"loss": output.loss, **output.metrics}
        for name, value in values.items():
            how = norms.get(name)
            rule = MEAN_RULE if how is None else REDUCTION_RULES[MetricNormalizer(how)]
            metric = self._validation_metric(f"val_{name}", rule.across_batches, value.device)
            metric.update(value)
            pl_module.log(
                f"val_{name}", metric, on_step=False, on_epoch=True, batch_size=1,
                prog_bar=name == "loss", metric_attribute=f"training_statistics.val_{name}",
            )  # fmt: skip

    def _step_output(self, outputs: Any, hook: str | None) -> StepOutput | None:
        """The `StepOutput` in a step's result, or `None` (warned once for `hook`)."""
        from lightning_mcore_rl.train import STEP_OUTPUT_KEY, StepOutput

        output = outputs.get(STEP_OUTPUT_KEY) if isinstance(outputs, Mapping) else None
        if isinstance(output, StepOutput):
            return output
        if hook is not None and not self._warned_no_output:
            self._warned_no_output = True
            warnings.warn(
                f"TrainingStatistics: `{hook}` returned {type(outputs).__name__}, not the step's "
                "result, so nothing is logged for it; return "
                "`self.forward_backward(batch).as_step_result()`.",
                UserWarning,
                stacklevel=2,
            )
        return None

    def _validation_metric(self, name: str, aggregation: str, device: torch.device) -> Metric:
        """The epoch aggregation of `name` (a torchmetrics `Metric` by `aggregation`)."""
        # global-batch values, already identical on every rank: no synchronisation
        from lightning_mcore_rl.metrics import AGGREGATIONS

        metric = self._val_metrics.get(name)
        if metric is None:
            metric = AGGREGATIONS[aggregation](sync_on_compute=False).to(device)
            self._val_metrics[name] = metric
        return metric

    # ---------------------------------------------------------------- what is logged

    def step_metrics(
        self, trainer: Trainer, pl_module: LightningModule, output: StepOutput
    ) -> dict[str, MetricValue]:
        """The values logged for one training step besides its timing, in its
        `on_train_batch_end` (override to add; keep them identical on every rank)."""
        record = _strategy(trainer).step_record
        # the non-finite policy's count, from the first skipped step on
        skipped: dict[str, MetricValue] = (
            {"skipped_steps": float(record.skipped_steps)}
            if record is not None and record.skipped_steps
            else {}
        )
        if record is not None and record.skipped:  # no loss, metrics or grad norm: not updated
            return skipped
        values: dict[str, MetricValue] = {"train_loss": output.loss, **skipped}
        values.update({f"train_{k}": v for k, v in output.metrics.items()})
        if record is not None and record.grad_norm is not None:
            values["grad_norm"] = float(record.grad_norm)
        if not math.isnan(output.response_length_mean):
            values["response_length_mean"] = output.response_length_mean
            values["response_length_max"] = output.response_length_max
        return values

    def timing_metrics(self, output: StepOutput, step_time: float) -> dict[str, MetricValue]:
        """The timing values of a step that was not skipped, once its `step_time` (s, the slowest
        rank's) is agreed one step later (override to add)."""
        values: dict[str, MetricValue] = {"step_time": step_time}
        if step_time > 0:
            values["tokens_per_sec"] = output.tokens / step_time
            values["samples_per_sec"] = output.samples / step_time
        return values

    def run_config(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Hyperparameters: the strategy's layout, precision and micro-batching, the loss's class
        and settings (`loss/<field>`), the sampling parameters."""
        config: dict[str, Any] = {
            f"strategy/{k}": v for k, v in _strategy(trainer).run_config().items()
        }
        loss_fn = getattr(pl_module, "loss_fn", None)
        if loss_fn is not None:
            config["loss/class"] = type(loss_fn).__name__
            cfg = getattr(loss_fn, "cfg", None)
            if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
                for key, value in dataclasses.asdict(cfg).items():
                    config[f"loss/{key}"] = value if _is_plain(value) else str(value)
        sampling = getattr(pl_module, "sampling_params", None)
        params = sampling() if callable(sampling) else None
        if dataclasses.is_dataclass(params) and not isinstance(params, type):
            for key, value in dataclasses.asdict(params).items():
                config[f"sampling/{key}"] = value
        return config


def _strategy(trainer: Trainer) -> MCoreRLStrategy:
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, MCoreRLStrategy):
        raise TypeError(f"TrainingStatistics needs MCoreRLStrategy, got {type(strategy).__name__}.")
    return strategy


@dataclass(frozen=True)
class _Row:
    """One step's logged values, kept until its ``step_time`` is agreed."""

    step: int  # Lightning's logger step of the training step (0-based)
    epoch: int
    values: dict[str, torch.Tensor]
    output: StepOutput | None  # for the timing metrics (None: a skipped step, none logged)


def _logs_step(trainer: Trainer) -> bool:
    """Whether Lightning's `log_every_n_steps` rule logs this training step."""
    # read in `on_train_batch_end`: `global_step` already counts this step
    # both set on the Trainer by Lightning's connectors at construction (not declared on it)
    every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
    if trainer.fast_dev_run:  # type: ignore[attr-defined]
        return True
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def _logged_tensor(key: str, value: MetricValue) -> torch.Tensor:
    """`value` as a detached 0-d tensor: float64 for the `TIMING_METRICS`, float32 for other
    Python numbers (as `self.log` stores them)."""
    # `self.log` would round a timing value to float32
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"TrainingStatistics: `{key}` must be a scalar, got a tensor of shape "
                f"{tuple(value.shape)}; reduce it in `step_metrics`."
            )
        return value.detach().reshape(())
    dtype = torch.float64 if key in TIMING_METRICS else torch.float32
    return torch.tensor(value, dtype=dtype)


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
