"""``TrainingStatistics``: log every step's loss, metrics, grad norm, timing and throughput."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import Metric

if TYPE_CHECKING:
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy
    from lightning_mcore_rl.train import StepOutput

MetricValue = float | torch.Tensor

TIMING_METRICS = ("step_time", "tokens_per_sec", "samples_per_sec")
"""Logged keys that measure wall time (all others are functions of the data and the model)."""


class TrainingStatistics(Callback):
    """Logs the statistics of every optimizer step through ``pl_module.log_dict`` — once per
    step, identical on every rank — so CSV, TensorBoard and W&B loggers receive each value once
    (at Lightning's step, 0-based; every ``Trainer(log_every_n_steps=...)`` steps: set 1, since
    Lightning's default of 50 sends a short run's loggers nothing).

    The step's loss and metrics are the step's data: the
    :class:`~lightning_mcore_rl.train.StepOutput` the module's ``training_step`` returns
    (``StepOutput.as_step_result()``, every metric already combined by its
    ``MetricNormalizer`` rule over packed sequences, microbatches, pipeline stages and
    data-parallel ranks). Logged per training step:

    * ``train_loss``, ``train_<metric>`` for each loss metric, ``grad_norm`` (pre-clip, global);
    * ``step_time`` (s, the slowest rank), ``tokens_per_sec`` / ``samples_per_sec`` (real tokens
      and samples of the global batch, counted once per data-parallel replica);
    * ``response_length_mean`` / ``response_length_max`` (``token_mask`` tokens per valid sample,
      when batches have a ``token_mask``);
    * ``skipped_steps``: steps skipped so far by the strategy's non-finite policy, from the
      first skipped step on (a skipped step logs only this value).

    Validation: ``val_loss`` and ``val_<metric>``, aggregated over the epoch's batches by the
    ``across_batches`` column of :data:`~lightning_mcore_rl.losses.REDUCTION_RULES` (means of
    normalised metrics, sums of counts, min/max). At fit start the loggers receive the run's
    layout, precision, micro-batching and loss settings as hyperparameters.

    :class:`~lightning_mcore_rl.MCoreRLModule` adds one to every run; pass an instance (or a
    subclass overriding :meth:`step_metrics`) in ``Trainer(callbacks=...)`` to replace it. It
    logs in ``on_train_batch_end`` (after megatron's optimizer step: the grad norm comes from
    the optimizer's last step record, the skip count from the strategy's non-finite policy) and
    moves itself to the front of ``trainer.callbacks`` in ``setup``, so every other callback's
    ``on_train_batch_end`` already sees this step's values. A ``training_step`` that returns no
    ``StepOutput`` logs nothing (one warning). The :data:`TIMING_METRICS` are logged in float64
    (``tokens_per_sec * step_time`` gives back the token count); other Python numbers get
    Lightning's float32.

    Args:
        prog_bar: metric names also shown in the progress bar.
    """

    def __init__(self, prog_bar: tuple[str, ...] = ("train_loss",)) -> None:
        self.prog_bar = prog_bar
        self._start: float | None = None
        self._val_metrics: dict[str, Metric] = {}
        self._warned_no_output = False

    # ---------------------------------------------------------------- hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Move this callback to the front of ``trainer.callbacks`` (a new list: Lightning's
        loop over the old one is unaffected), so it logs before any other callback's
        ``on_train_batch_end`` reads ``trainer.callback_metrics``."""
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        trainer.callbacks = [self, *(c for c in callbacks if c is not self)]  # type: ignore[attr-defined]

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the run configuration as hyperparameters (rank 0's loggers)."""
        config = self.run_config(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_hyperparams(config)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the step from its ``outputs`` (the ``training_step`` result), after megatron's
        optimizer step."""
        strategy = _strategy(trainer)
        output = self._step_output(outputs, "training_step")
        if output is None:
            return
        elapsed = time.perf_counter() - (self._start or time.perf_counter())
        elapsed = _slowest(elapsed, strategy.root_device, strategy.world_group)
        raw = self.step_metrics(trainer, pl_module, output, elapsed)
        values = {k: _float64(v) if k in TIMING_METRICS else v for k, v in raw.items()}
        shown = {k: v for k, v in values.items() if k in self.prog_bar}
        hidden = {k: v for k, v in values.items() if k not in self.prog_bar}
        for group, prog_bar in ((shown, True), (hidden, False)):
            if group:
                pl_module.log_dict(
                    group, batch_size=1, on_step=True, on_epoch=False, prog_bar=prog_bar
                )

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
        """The :class:`~lightning_mcore_rl.train.StepOutput` in a step's result, or ``None``
        (warned once for ``hook``: a training step whose statistics cannot be logged)."""
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
        """The epoch aggregation of ``name`` (torchmetrics, by the rule table's
        ``across_batches``; Lightning computes it at epoch end and resets it). The values are
        global-batch values, already identical on every rank: no synchronisation."""
        from lightning_mcore_rl.metrics import AGGREGATIONS

        metric = self._val_metrics.get(name)
        if metric is None:
            metric = AGGREGATIONS[aggregation](sync_on_compute=False).to(device)
            self._val_metrics[name] = metric
        return metric

    # ---------------------------------------------------------------- what is logged

    def step_metrics(
        self, trainer: Trainer, pl_module: LightningModule, output: StepOutput, step_time: float
    ) -> dict[str, MetricValue]:
        """The values logged for one training step (override to add; keep them identical on
        every rank).

        Args:
            trainer: the Trainer.
            pl_module: the module.
            output: the step's statistics.
            step_time: wall time of the step in seconds (the slowest rank's).
        """
        strategy = _strategy(trainer)
        # the non-finite policy's count, from the first skipped step on
        guard = strategy.nonfinite_guard
        skipped: dict[str, MetricValue] = (
            {"skipped_steps": float(guard.skipped_steps)} if guard.skipped_steps else {}
        )
        if guard.step_skipped:  # no loss, metrics or grad norm: the step did not run/update
            return skipped
        values: dict[str, MetricValue] = {"train_loss": output.loss, **skipped}
        values.update({f"train_{k}": v for k, v in output.metrics.items()})
        last = strategy.last_optimizer_step
        if last is not None and last.grad_norm is not None:
            values["grad_norm"] = float(last.grad_norm)
        values["step_time"] = step_time
        if step_time > 0:
            values["tokens_per_sec"] = output.tokens / step_time
            values["samples_per_sec"] = output.samples / step_time
        if not math.isnan(output.response_length_mean):
            values["response_length_mean"] = output.response_length_mean
            values["response_length_max"] = output.response_length_max
        return values

    def run_config(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Hyperparameters: the strategy's layout, precision and micro-batching, and the loss's
        class and settings (``loss/<field>``)."""
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


def _slowest(seconds: float, device: torch.device, group: Any) -> float:
    """The max of ``seconds`` over all ranks (one small all-reduce on the strategy's world
    group, bounded by its timeout), so every rank logs it."""
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.cpu())


def _float64(value: MetricValue) -> MetricValue:
    """A Python number as a 0-d float64 tensor (``self.log`` would round it to float32)."""
    return torch.tensor(value, dtype=torch.float64) if isinstance(value, (int, float)) else value


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
