"""Rank function of the MoE resume tests: the tiny MoE GPT's ClippedPG steps under a Trainer,
saved at one expert layout and resumed at another (module-level: pickled to the ranks)."""

from __future__ import annotations

import os
from typing import Any

from _strategy_moe_runs import MoEGRPOModule, MoESpec, moe_loader, moe_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore_rl.strategy.resumable import ResumableLoader
from lightning_mcore_rl.testing import destroy_megatron_state

SAVED_AT, STEPS = 2, 4


def _fit(spec: MoESpec, steps: int, **kwargs: Any) -> dict[str, Any]:
    destroy_megatron_state()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer, recorder = moe_trainer(spec, steps, **kwargs)
    loader = ResumableLoader(moe_loader(spec))  # the resume continues at the saved batch
    trainer.fit(MoEGRPOModule(spec), loader, ckpt_path=ckpt_path)
    return {"losses": [m["train_loss"] for m in recorder.metrics],
            "grad_norms": recorder.grad_norms, "global_step": trainer.global_step}  # fmt: skip


def moe_resume_rank(_rank: int, saved: MoESpec, resumed: MoESpec, root: str) -> dict[str, Any]:
    """An uninterrupted ``STEPS``-step run at ``resumed``'s layout, then ``SAVED_AT`` steps at
    ``saved``'s (checkpointed) resumed at ``resumed``'s to ``STEPS``; the resume's error
    (``"Type: message"``) instead of its run if it raises."""
    reference = _fit(resumed, STEPS)
    saver = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=SAVED_AT)
    _fit(saved, SAVED_AT, callbacks=[saver], enable_checkpointing=True)
    path = os.path.join(root, f"step={SAVED_AT}.ckpt")
    try:
        run: Any = _fit(resumed, STEPS, ckpt_path=path)
    except Exception as err:  # noqa: BLE001 - the message is the result
        run = f"{type(err).__name__}: {err}"
    return {"reference": reference, "resumed": run}
