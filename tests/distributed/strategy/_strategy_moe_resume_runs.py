"""Rank function of the MoE resume tests: the tiny MoE GPT's ClippedPG steps under a Trainer
(warm-up LR schedule stepped every step), uninterrupted at EP=1 and EP=2 with a checkpoint after
``SAVED_AT`` steps, and each checkpoint resumed at both EP sizes, in fp32 or bf16-mixed
(module-level: pickled to the ranks)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from _strategy_moe_runs import MoEGRPOModule, MoESpec, moe_loader, moe_trainer
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.lr_scheduler import LambdaLR

from lightning_mcore_rl.strategy import MegatronOptimizerSpec
from lightning_mcore_rl.strategy.resumable import ResumableLoader
from lightning_mcore_rl.testing import destroy_megatron_state

SAVED_AT, STEPS = 2, 4
EP1, EP2 = MoESpec(ep=1, aux=0.01), MoESpec(ep=2, aux=0.01)
BF16 = (("bf16", True), ("params_dtype", torch.bfloat16))  # TransformerConfig of bf16-mixed


def _ramp(step: int) -> float:
    """LR factor of the optimizer step ``step`` (0-based): a warm-up that changes every step."""
    return (step + 1) / (STEPS + 1)


def _warmup(optimizer: Any) -> dict[str, Any]:
    return {"scheduler": LambdaLR(optimizer, _ramp), "interval": "step"}


class ScheduledMoEModule(MoEGRPOModule):
    """The tiny MoE GRPO module with the warm-up LR schedule."""

    def configure_optimizers(self) -> Any:
        return MegatronOptimizerSpec(super().configure_optimizers(), lr_scheduler=_warmup)


def _megatron_members(trainer: Trainer) -> list[Any]:
    return trainer.strategy.optimizers[0].megatron_optimizer.chained_optimizers


class OptimizerProbe(Callback):
    """After the restore (train start): every parameter's Adam step count; before every step:
    each parameter group's learning rate."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.steps: list[float] = []
        self.lrs: list[list[float]] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        members = _megatron_members(trainer)
        if self.fresh:  # the control: resume with fresh optimizer state
            for member in members:
                member.optimizer.state.clear()
        states = [s for m in members for s in m.optimizer.state.values()]
        self.steps = sorted({float(s["step"]) for s in states if "step" in s})

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.lrs.append([float(g["lr"]) for g in trainer.strategy.optimizers[0].param_groups])


def _fit(
    spec: MoESpec, steps: int, precision: str, root: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    """``steps`` steps at ``spec``'s layout (from ``ckpt_path`` if given); with ``root``, every
    ``SAVED_AT`` steps a checkpoint ``root/step=N.ckpt``."""
    destroy_megatron_state()
    probe = OptimizerProbe(kwargs.pop("fresh", False))
    callbacks: list[Callback] = [probe]
    if root is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, filename="{step}", save_top_k=-1,
                                         every_n_train_steps=SAVED_AT))  # fmt: skip
    trainer, recorder = moe_trainer(spec, steps, callbacks=callbacks, precision=precision,
                                    enable_checkpointing=root is not None)  # fmt: skip
    loader = ResumableLoader(moe_loader(spec))  # the resume continues at the saved batch
    trainer.fit(ScheduledMoEModule(spec), loader, **kwargs)
    return {"metrics": recorder.metrics, "grad_norms": recorder.grad_norms, "lrs": probe.lrs,
            "adam_steps": probe.steps, "global_step": trainer.global_step}  # fmt: skip


def moe_resume_rank(_rank: int, root: str, precision: str) -> dict[str, Any]:
    """Uninterrupted ``STEPS``-step runs at EP=1 and EP=2 (checkpointed after ``SAVED_AT``);
    each EP's checkpoint resumed at EP=1 and at EP=2; and the EP=2 checkpoint resumed at EP=1
    with its optimizer state dropped after the restore (the control)."""
    bf16 = precision == "bf16-mixed"
    ep1, ep2 = (replace(s, overrides=BF16) if bf16 else s for s in (EP1, EP2))
    out: dict[str, Any] = {}
    for spec in (ep1, ep2):
        out[f"ep{spec.ep}"] = _fit(spec, STEPS, precision, os.path.join(root, f"ep{spec.ep}"))
    for saved in (ep1, ep2):
        path = os.path.join(root, f"ep{saved.ep}", f"step={SAVED_AT}.ckpt")
        for resumed in (ep1, ep2):
            out[f"ep{saved.ep}->ep{resumed.ep}"] = _fit(resumed, STEPS, precision, ckpt_path=path)
    path = os.path.join(root, "ep2", f"step={SAVED_AT}.ckpt")
    out["ep2->ep1 fresh"] = _fit(ep1, STEPS, precision, ckpt_path=path, fresh=True)
    return out
