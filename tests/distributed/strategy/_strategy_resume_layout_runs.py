"""Rank functions for ``fit(ckpt_path=...)`` under another parallel layout: in ONE spawned process
group, an uninterrupted reference fit at the new layout, then per layout change a fit at the
saved layout that checkpoints at its last step and a fit at the new layout resumed from it
(megatron's parallel state is rebuilt between layouts). The fits are
:func:`~_strategy_runs._fit_and_record`'s (tiny GPT, Adam, LambdaLR, ``ResumableLoader``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from _strategy_runs import RunSummary, _fit_and_record, _summary
from helpers.distributed import RunSpec
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore_rl.testing import destroy_megatron_state


@dataclass(frozen=True)
class LayoutChange:
    """Fit ``saved.steps`` steps at ``saved`` (checkpoint at the last one), then resume at
    ``resumed`` up to ``resumed.steps``."""

    saved: RunSpec
    resumed: RunSpec


@dataclass(frozen=True)
class ResumedRun:
    """One resumed fit on one rank: the saved fit's steps (None: saved elsewhere), the resumed
    fit's steps, its ``global_step`` and the Adam step counts of its optimizer state
    afterwards; or the error the resumed fit raised (``"Type: message"``)."""

    saved: RunSummary | None
    resumed: RunSummary | None
    global_step: int
    adam_steps: list[float]
    error: str = ""


@dataclass(frozen=True)
class LayoutResumes:
    """One rank of :func:`resume_layouts_rank` / :func:`resume_from_rank`."""

    reference: RunSummary | None
    changes: dict[str, ResumedRun]


def adam_steps(optimizer: object) -> list[float]:
    """The distinct ``step`` values of a megatron optimizer's torch Adam state."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    steps = {float(s["step"]) for o in inner for s in o.optimizer.state.values() if "step" in s}
    return sorted(steps)


def _reference(rank: int, spec: RunSpec | None) -> RunSummary | None:
    return None if spec is None else _summary(_fit_and_record(spec, rank)[2])


def _resume(rank: int, spec: RunSpec, path: str, saved: RunSummary | None) -> ResumedRun:
    destroy_megatron_state()
    try:
        trainer, _, resumed = _fit_and_record(spec, rank, ckpt_path=path)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return ResumedRun(saved, None, -1, [], f"{type(err).__name__}: {err}")
    steps = adam_steps(trainer.strategy.megatron_optimizer)
    return ResumedRun(saved, _summary(resumed), trainer.global_step, steps)


def resume_layouts_rank(
    rank: int, reference: RunSpec | None, changes: dict[str, LayoutChange], ckpt_root: str
) -> LayoutResumes:
    """The reference fit (if any), then each change: save at its layout into
    ``ckpt_root/<name>/step=<saved.steps>.ckpt``, resume at the new one."""
    ref = _reference(rank, reference)
    out = {}
    for name, change in changes.items():
        ckpt_dir = os.path.join(ckpt_root, name)
        saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}",
                                every_n_train_steps=change.saved.steps)  # fmt: skip
        destroy_megatron_state()
        _, _, saved = _fit_and_record(change.saved, rank, callbacks=[saver],
                                      enable_checkpointing=True)  # fmt: skip
        path = os.path.join(ckpt_dir, f"step={change.saved.steps}.ckpt")
        out[name] = _resume(rank, change.resumed, path, _summary(saved))
    return LayoutResumes(ref, out)


def resume_from_rank(rank: int, reference: RunSpec, resumed: RunSpec, path: str) -> LayoutResumes:
    """The reference fit, then ``resumed`` from a checkpoint saved by another process group
    (e.g. under another world size); the result's change is named ``"resumed"``."""
    ref = _reference(rank, reference)
    return LayoutResumes(ref, {"resumed": _resume(rank, resumed, path, None)})
