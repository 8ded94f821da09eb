"""Rank functions for the strategy tests: the tiny GPT trained by a Lightning ``Trainer`` with
``MCoreRLStrategy`` and by the bare megatron loop of ``lightning_mcore_rl.testing.training``.

Both runs read the same data: Lightning injects a ``DistributedSampler`` over the data-parallel
group (shuffle=True, seed 0, epoch 0) and the bare loop draws its batches from the same sampler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers.distributed import RunSpec
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import (
    CheckpointConfig,
    MegatronDDPConfig,
    MegatronOptimizerSpec,
    MicrobatchConfig,
    ResumableLoader,
)
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state
from lightning_mcore_rl.testing.training import build_training, forward_backward, optimizer_step

VOCAB = 128
SEQ = 16


class TokenRows(Dataset):
    """Deterministic LM samples ``{"tokens": [S], "labels": [S]}``."""

    def __init__(self, num_rows: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (num_rows, SEQ + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {"tokens": row[:-1], "labels": row[1:]}


class TinyGPTModule(MCoreRLModule):
    """The tiny GPT (layout-invariant weights) with the bare loop's Adam settings."""

    def __init__(self, num_layers: int = 2, lr: float = 1e-3, schedule: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.step_outputs: list[Any] = []

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        strategy = self.mcore_strategy
        config = tiny_gpt_config(
            self.parallel_groups,
            num_layers=self.hparams.num_layers,
            bf16=strategy.precision_plugin.bf16,
            sequence_parallel=strategy.parallel.sequence_parallel,
        )
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        config = OptimizerConfig(
            optimizer="adam", lr=self.hparams.lr, adam_eps=1e-4, weight_decay=0.0
        )
        if not self.hparams.schedule:
            return config

        def scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
            lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
            return {"scheduler": lambda_lr, "interval": "step"}

        return MegatronOptimizerSpec(config=config, lr_scheduler=scheduler)

    def training_step(self, batch: Any, batch_idx: int = 0) -> dict[str, Any]:
        out = self.forward_backward(batch)
        self.step_outputs.append(out)
        self.log_dict({"train_loss": out.loss}, batch_size=1)
        return out.as_step_result()


class Recorder(Callback):
    """Per step: every rank's ``callback_metrics`` (as floats) and the microbatch losses."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.microbatch_losses: list[tuple[float, ...]] = []
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []
        self.batch_sums: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        self.batch_sums.append(int(batch["tokens"].sum()))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.microbatch_losses.append(pl_module.step_outputs[-1].microbatch_losses)
        optimizer = trainer.strategy.optimizers[0]
        self.grad_norms.append(optimizer.last_step.grad_norm)
        self.lrs.append(optimizer.param_groups[0]["lr"])


@dataclass(frozen=True)
class BareRun:
    """The bare loop per step: this rank's microbatch losses (empty off the last stage), megatron's
    grad norm and (GRPO only) the forward-only logprobs before the update."""

    losses: list[tuple[float, ...]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    logprobs: list[torch.Tensor | None] = field(default_factory=list)


@dataclass(frozen=True)
class FitResult:
    """One rank of :func:`fit_rank`: the bare loop and what the Lightning run recorded."""

    bare: BareRun
    metrics: list[dict[str, float]]
    microbatch_losses: list[tuple[float, ...]]
    batch_sums: list[int]
    grad_norms: list[float]
    global_step: int
    sampler: dict[str, Any]


@dataclass(frozen=True)
class RunSummary:
    """Per step of a recorded fit: microbatch losses, grad norm, LR and logged ``train_loss``."""

    microbatch_losses: list[tuple[float, ...]]
    grad_norms: list[float]
    lrs: list[float]
    train_loss: list[float]


@dataclass(frozen=True)
class ResumeResult:
    """One rank of :func:`resume_rank`."""

    full: RunSummary
    resumed: RunSummary
    global_step: int
    val_loss: float
    files: list[str]


@dataclass(frozen=True)
class AtomicSaveResult:
    """The failed second save's error type and what the checkpoint still loads."""

    error: str
    loaded: dict[str, Any]


def strategy_kwargs(spec: RunSpec) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": spec.tp,
        "pipeline_model_parallel_size": spec.pp,
        "virtual_pipeline_model_parallel_size": spec.vpp,
        "context_parallel_size": spec.cp,
        "sequence_parallel": spec.sequence_parallel,
        "microbatching": MicrobatchConfig(micro_batch_size=spec.mbs),
        "ddp": MegatronDDPConfig(use_distributed_optimizer=spec.distributed_optimizer),
        "checkpoint": CheckpointConfig(optimizer_sharding=spec.optimizer_sharding),
    }


def make_trainer(spec: RunSpec, world_size: int, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world_size,
        "max_steps": spec.steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "gradient_clip_val": spec.clip,
        "precision": spec.precision,
    }
    options.update(kwargs)
    if "strategy" not in options:
        options["strategy"] = MCoreRLStrategy(**strategy_kwargs(spec))
    return Trainer(**options)


def fit_rank(rank: int, spec: RunSpec) -> FitResult:
    """Bare loop first, then the Lightning run, in the same rank process."""
    world_size = int(os.environ["WORLD_SIZE"])
    bare = bare_run(spec, world_size)
    destroy_megatron_state()
    recorder = Recorder()
    trainer = make_trainer(spec, world_size, callbacks=[recorder])
    module = TinyGPTModule(num_layers=spec.num_layers)
    loader = DataLoader(TokenRows(spec.rows), batch_size=spec.local_batch(world_size))
    trainer.fit(module, loader)
    return FitResult(
        bare=bare,
        metrics=recorder.metrics,
        microbatch_losses=recorder.microbatch_losses,
        batch_sums=recorder.batch_sums,
        grad_norms=recorder.grad_norms,
        global_step=trainer.global_step,
        sampler=dict(trainer.strategy.distributed_sampler_kwargs),
    )


def bare_run(spec: RunSpec, world_size: int) -> BareRun:
    """The bare megatron loop on the batches Lightning's injected sampler yields."""
    from megatron.core import parallel_state as ps

    init_megatron_state(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
    )
    setup = build_training(
        num_layers=spec.num_layers,
        use_distributed_optimizer=spec.distributed_optimizer,
        clip_grad=0.0 if spec.clip is None else spec.clip,
        sequence_parallel=spec.sequence_parallel,
        bf16=spec.bf16,
    )
    dataset = TokenRows(spec.rows)
    sampler = DistributedSampler(
        dataset,
        num_replicas=ps.get_data_parallel_world_size(),
        rank=ps.get_data_parallel_rank(),
        shuffle=True,
        seed=0,
    )
    indices = list(sampler)
    local, mbs = spec.local_batch(world_size), spec.mbs
    out = BareRun()
    for step in range(spec.steps):
        rows = [dataset[i] for i in indices[step * local : (step + 1) * local]]
        tokens = torch.stack([r["tokens"] for r in rows])
        labels = torch.stack([r["labels"] for r in rows])
        microbatches = [
            {"tokens": tokens[i : i + mbs], "labels": labels[i : i + mbs]}
            for i in range(0, local, mbs)
        ]
        out.losses.append(forward_backward(setup, microbatches))
        out.grad_norms.append(optimizer_step(setup))
    return out


def _resumable_loader(spec: RunSpec, world_size: int, rank: int) -> ResumableLoader:
    """This DP rank's batches in a fixed order (megatron's rank order tp-cp-dp-pp: TP fastest)."""
    dataset = TokenRows(spec.rows)
    dp_size = world_size // (spec.tp * spec.pp * spec.cp)
    dp_rank = rank // (spec.tp * spec.cp) % dp_size
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=spec.local_batch(world_size), sampler=sampler)
    return ResumableLoader(loader)


def _fit_and_record(
    spec: RunSpec, rank: int, ckpt_path: str | None = None, **trainer_kwargs: Any
) -> tuple[Trainer, TinyGPTModule, Recorder]:
    world_size = int(os.environ["WORLD_SIZE"])
    recorder = Recorder()
    callbacks = [recorder, *trainer_kwargs.pop("callbacks", [])]
    trainer = make_trainer(spec, world_size, callbacks=callbacks, **trainer_kwargs)
    module = TinyGPTModule(num_layers=spec.num_layers, schedule=True)
    trainer.fit(module, _resumable_loader(spec, world_size, rank), ckpt_path=ckpt_path)
    return trainer, module, recorder


def _summary(recorder: Recorder) -> RunSummary:
    return RunSummary(
        microbatch_losses=recorder.microbatch_losses,
        grad_norms=recorder.grad_norms,
        lrs=recorder.lrs,
        train_loss=[m["train_loss"] for m in recorder.metrics],
    )


def resume_rank(rank: int, spec: RunSpec, ckpt_dir: str) -> ResumeResult:
    """6 uninterrupted steps saving at steps 3 and 6 (mid-epoch), then a second Trainer resumed
    from step 3 to step 6 in the same process, then ``validate`` on that Trainer."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    _, _, full = _fit_and_record(spec, rank, callbacks=[saver], enable_checkpointing=True)
    trainer, module, resumed = _fit_and_record(spec, rank, ckpt_path=f"{ckpt_dir}/step=3.ckpt")
    val = trainer.validate(module, DataLoader(TokenRows(8, seed=1), batch_size=4), verbose=False)
    return ResumeResult(
        full=_summary(full),
        resumed=_summary(resumed),
        global_step=trainer.global_step,
        val_loss=val[0]["val_loss"],
        files=sorted(os.listdir(ckpt_dir)),
    )


def validate_rank(rank: int, spec: RunSpec, ckpt_path: str) -> float:
    """``Trainer.validate(ckpt_path=...)`` under the layout of ``spec``."""
    world_size = int(os.environ["WORLD_SIZE"])
    trainer = make_trainer(spec, world_size)
    module = TinyGPTModule(num_layers=spec.num_layers, schedule=True)
    loader = DataLoader(TokenRows(8, seed=1), batch_size=4)
    return trainer.validate(module, loader, ckpt_path=ckpt_path, verbose=False)[0]["val_loss"]


def atomic_save_rank(rank: int, path: str) -> AtomicSaveResult:
    """Save, then fail a second save half-way: the first checkpoint must still load."""
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from lightning_mcore_rl.strategy import checkpoint as ckpt

    ckpt.save({"value": 1}, Path(path), atomic=True)
    error = ""
    try:
        ckpt.save({"value": 2, "unpicklable": lambda: 0}, Path(path), atomic=True)
    except Exception as err:  # noqa: BLE001 - the failure is the point
        error = type(err).__name__
    return AtomicSaveResult(error, dist_checkpointing.load_common_state_dict(path))


class _PlainModule(LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.zeros(())

    def configure_optimizers(self) -> Any:
        return None


def trainer_errors_rank(rank: int) -> dict[str, str]:
    """Each misconfiguration through a real ``Trainer.fit`` on one rank: the error it raises."""
    loader = DataLoader(TokenRows(8), batch_size=2)
    one_step = RunSpec(steps=1)
    cases: dict[str, tuple[RunSpec, dict[str, Any], Any]] = {
        "accumulate": (one_step, {"accumulate_grad_batches": 2}, TinyGPTModule()),
        "clip_value": (
            one_step,
            {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
            TinyGPTModule(),
        ),
        "sizes": (RunSpec(steps=1, tp=2), {}, TinyGPTModule()),
        "plain_module": (one_step, {}, _PlainModule()),
    }
    errors = {}
    for name, (spec, trainer_kwargs, module) in cases.items():
        trainer = make_trainer(spec, 1, **trainer_kwargs)
        try:
            trainer.fit(module, loader)
            errors[name] = ""
        except Exception as err:  # noqa: BLE001 - the message is the result
            errors[name] = f"{type(err).__name__}: {err}"
    # bf16 Trainer but a module that builds an fp32 config.
    trainer = make_trainer(RunSpec(steps=1, bf16=True), 1)
    module = TinyGPTModule()
    module.build_chunk = lambda vp_stage: tiny_gpt(tiny_gpt_config(), vocab_size=VOCAB)  # type: ignore[method-assign]
    try:
        trainer.fit(module, loader)
        errors["config"] = ""
    except Exception as err:  # noqa: BLE001
        errors["config"] = f"{type(err).__name__}: {err}"
    return errors
