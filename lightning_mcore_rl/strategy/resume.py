"""`ckpt_path="last"` never silently starts over: `ResumeGuardLauncher` recovers interrupted
saves and refuses a fresh start over complete checkpoints, on every rank, before the run."""

# Lightning resolves `fit(ckpt_path="last")` to the newest `last*.ckpt` of the `ModelCheckpoint`
# directories before the strategy sees the run, and starts from step 0 (a warning) when there is
# none: a fresh start would silently discard complete checkpoints. An empty checkpoint directory
# still starts fresh (the first launch of a restartable job).

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn

from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.strategy.optimizer import check_fit_limits


class ResumeGuardLauncher(_Launcher):
    """Runs `guard_last_checkpoint` (and, for `fit`, `check_fit_limits`) before `inner` launches
    (without one, before the trainer function is called directly)."""

    def __init__(self, inner: _Launcher | None) -> None:
        self.inner = inner

    @property
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible if self.inner is not None else True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            if trainer.state.fn == TrainerFn.FITTING:  # before the ranks start: one error
                check_fit_limits(trainer.max_steps, trainer.max_epochs)
            guard_last_checkpoint(function, args, kwargs, trainer)
        if self.inner is not None:
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        if self.inner is not None:
            kill = getattr(self.inner, "kill", None)
            if kill is not None:
                kill(signum)


def guard_last_checkpoint(
    function: Callable, args: tuple[Any, ...], kwargs: dict[str, Any], trainer: Any
) -> None:
    """With `ckpt_path="last"`: recover interrupted saves in every `ModelCheckpoint` directory,
    then refuse a fresh start over complete checkpoints.

    Raises:
        FileNotFoundError: no `last*.ckpt` but complete `*.ckpt` exist; or no complete
            `last*.ckpt` entry (`checkpoint.check_last`)."""
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return
    if bound.arguments.get("ckpt_path") != "last":
        return
    from lightning.pytorch.callbacks import ModelCheckpoint

    directories = [
        Path(cb.dirpath)
        for cb in getattr(trainer, "checkpoint_callbacks", [])
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None
    ]
    for directory in directories:
        ckpt.recover_interrupted(directory)
    for directory in directories:
        ckpt.check_last(directory, ModelCheckpoint.CHECKPOINT_NAME_LAST)  # dangling `last`
        complete = ckpt.complete_checkpoints(directory)
        if complete and not any(p.name.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) for p in
                                complete):  # fmt: skip
            raise FileNotFoundError(
                f'`fit(ckpt_path="last")` found no last checkpoint in {directory}, but complete '
                f"checkpoints exist there ({', '.join(p.name for p in complete)}); resuming "
                "from none would silently start over. Pass the one to resume from, e.g. "
                f'`ckpt_path="{complete[-1]}"`, or set `ModelCheckpoint(save_last=True)`.'
            )


__all__ = ["ResumeGuardLauncher", "guard_last_checkpoint"]


def check_resumed_fit_trained(trainer: Any, start_step: int) -> None:
    """Raise, on every rank, when a resumed `fit` stopped before training a step below
    `max_steps` (instead of exiting as if it had trained).

    Raises:
        RuntimeError: `fit(ckpt_path=...)` trained no step below `max_steps`."""
    steps_left = trainer.max_steps == -1 or trainer.global_step < trainer.max_steps
    if trainer.ckpt_path is None or trainer.global_step != start_step or not steps_left:
        return
    # Typically the checkpoint closed its epoch (max_steps stopped the run there) and
    # max_epochs ends the resumed run at that epoch's end: Lightning then trains nothing.
    raise RuntimeError(
        f"`Trainer.fit(ckpt_path={str(trainer.ckpt_path)!r})` resumed at global step "
        f"{start_step} and stopped at epoch {trainer.current_epoch} without training a step "
        f"although max_steps={trainer.max_steps}: max_epochs={trainer.max_epochs} ended it. "
        "Resume with a larger max_steps and no epoch bound, e.g. `--trainer.max_steps=N "
        "--trainer.max_epochs=-1` (Trainer(max_steps=N, max_epochs=-1)); see docs/strategy.md."
    )
