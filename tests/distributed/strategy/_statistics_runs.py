"""Rank functions for ``test_training_statistics``: the ``MCoreRLModule(loss_fn=ClippedPGLossFn)``
path fitted with real W&B (offline), TensorBoard and CSV loggers, every step's logged values and
batch recorded for the test's independent references."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _strategy_rl_runs import PG_CFG, RolloutRows
from _strategy_runs import VOCAB, make_trainer
from helpers.distributed import RunSpec
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule
from lightning_mcore_rl.callbacks import TrainingStatistics
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.testing import destroy_megatron_state

STEPS = 3
ROWS = 24
TP2 = RunSpec(tp=2, steps=STEPS, rows=ROWS, global_batch=4)
DP2 = RunSpec(steps=STEPS, rows=ROWS, global_batch=8)


class PGModule(MCoreRLModule):
    """The base ``training_step`` (``TrainingStatistics`` does all the logging)."""

    def __init__(self) -> None:
        super().__init__(loss_fn=ClippedPGLossFn(PG_CFG))

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(self.parallel_groups, calculate_per_token_loss=True)
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=1e-4, weight_decay=0.0)


class TokensPerSample(TrainingStatistics):
    """Adds ``tokens_per_sample`` (real tokens over samples of the global batch)."""

    def step_metrics(self, trainer: Any, pl_module: Any, output: Any) -> Any:
        values = super().step_metrics(trainer, pl_module, output)
        values["tokens_per_sample"] = output.tokens / output.samples
        return values


@dataclass(frozen=True)
class StepRecord:
    """One step on one rank: ``callback_metrics`` and ``progress_bar_metrics`` after it and
    this rank's batch counts."""

    metrics: dict[str, float]
    progress_bar: dict[str, Any]
    tokens: float  # sum of input_lengths
    samples: int
    response_lengths: list[float]  # token_mask tokens per sample (every sample_mask is 1)
    input_ids: list[list[int]]


class RecordingLogger(Logger):
    """Records every ``log_metrics`` call on EVERY rank (Lightning's loggers write on rank 0
    only), into ``events`` as ``("log", step, metrics)`` next to the recorder's markers."""

    def __init__(self, events: list[tuple[str, int, dict[str, float]]]) -> None:
        super().__init__()
        self.events = events

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        assert step is not None
        self.events.append(("log", step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class StepRecorder(Callback):
    def __init__(self, events: list[tuple[str, int, dict[str, float]]]) -> None:
        self.steps: list[StepRecord] = []
        self.events = events
        self._batch: Any = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int
    ) -> None:
        self._batch = batch
        self.events.append(("start", trainer.global_step, {}))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        batch = self._batch
        assert bool(batch["sample_mask"].all())
        self.steps.append(
            StepRecord(
                metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                progress_bar=dict(trainer.progress_bar_metrics),
                tokens=float(batch["input_lengths"].sum()),
                samples=int(batch["input_ids"].shape[0]),
                response_lengths=batch["token_mask"].sum(-1).tolist(),
                input_ids=batch["input_ids"].tolist(),
            )
        )


@dataclass(frozen=True)
class FitRecord:
    """One fit on one rank."""

    steps: list[StepRecord]
    statistics_callbacks: list[str]  # type names of the TrainingStatistics in trainer.callbacks
    run_config: dict[str, Any]
    global_step: int
    events: list[tuple[str, int, dict[str, float]]]  # step starts and every logger call, in order

    @property
    def logged(self) -> dict[int, dict[str, float]]:
        """The rows every logger received, by step (each step must be logged once)."""
        rows = [(step, metrics) for kind, step, metrics in self.events if kind == "log"]
        assert len({step for step, _ in rows}) == len(rows), [step for step, _ in rows]
        return dict(rows)


def _fit(
    spec: RunSpec, loggers: list[Logger], callbacks: list[Callback], progress_bar: bool = False
) -> FitRecord:
    world_size = int(os.environ["WORLD_SIZE"])
    events: list[tuple[str, int, dict[str, float]]] = []
    recorder = StepRecorder(events)
    trainer = make_trainer(
        spec, world_size, logger=[*loggers, RecordingLogger(events)],
        callbacks=[*callbacks, recorder], log_every_n_steps=1, enable_progress_bar=progress_bar,
    )  # fmt: skip
    module = PGModule()
    loader = DataLoader(RolloutRows(spec.rows), batch_size=spec.local_batch(world_size))
    trainer.fit(module, loader)
    callbacks_now = trainer.callbacks  # type: ignore[attr-defined]
    statistics = [c for c in callbacks_now if isinstance(c, TrainingStatistics)]
    config = statistics[0].run_config(trainer, module)
    for logger in loggers:
        logger.finalize("success")
    destroy_megatron_state()
    return FitRecord(
        steps=recorder.steps,
        statistics_callbacks=[type(c).__name__ for c in statistics],
        run_config=config,
        global_step=trainer.global_step,
        events=events,
    )


def statistics_rank(rank: int, root: str) -> dict[str, FitRecord]:
    """Three fits: TP=2 into W&B (offline) + TensorBoard + CSV with the module's default
    callback; DP=2 into CSV with a ``TrainingStatistics`` subclass and Lightning's progress bar;
    TP=2 into CSV with the default instance passed explicitly."""
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=root)
    base = Path(root)
    wandb = WandbLogger(offline=True, save_dir=str(base / "wandb"), project="stats")
    tb = TensorBoardLogger(str(base / "tb"), name="", version="run")
    out = {"tp2": _fit(TP2, [wandb, tb, CSVLogger(str(base), name="tp2", version="")], [])}
    if rank == 0:  # flush and close the run (the rank process exits without waiting for wandb)
        wandb.experiment.finish()
    csv = CSVLogger(str(base), name="dp2_subclass", version="")
    out["dp2"] = _fit(DP2, [csv], [TokensPerSample()], progress_bar=True)
    csv = CSVLogger(str(base), name="tp2_explicit", version="")
    out["explicit"] = _fit(TP2, [csv], [TrainingStatistics()])
    return out
