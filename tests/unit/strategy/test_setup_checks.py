"""Settings that would train nothing or that torch would reject deep inside megatron are refused
when ``fit`` launches or before megatron builds the optimizer, naming the setting."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from helpers.trainer import cpu_trainer
from megatron.core.optimizer import OptimizerConfig

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import SFTDataModule, SFTModule
from lightning_mcore_rl.strategy.optimizer import (
    build_optimizer,
    check_fit_limits,
    check_optimizer_values,
)


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"max_steps": 0}, r"`Trainer\(max_steps=0\)` trains no step .* or -1 to stop at"),
        ({"max_epochs": 0}, r"`Trainer\(max_epochs=0\)` trains no step .* Set `max_epochs` >= 1"),
    ],
)
def test_fit_with_no_step_raises_before_any_process_group(limits, match):
    trainer = cpu_trainer(strategy=MCoreRLStrategy(), **limits)
    with pytest.raises(ValueError, match=match):
        trainer.fit(SFTModule(), datamodule=SFTDataModule(num_steps=1))
    assert not dist.is_initialized()  # refused at launch: no rank, group or setup hook ran


def test_fit_limits_that_train_accept():
    check_fit_limits(max_steps=-1, max_epochs=None)  # Lightning's defaults (1000 epochs)
    check_fit_limits(max_steps=1, max_epochs=-1)
    check_fit_limits(max_steps=-1, max_epochs=1)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"lr": -1e-3}, r"`OptimizerConfig.lr=-0.001` must be a finite number >= 0"),
        ({"lr": math.nan}, r"`OptimizerConfig.lr=nan` must be a finite number >= 0"),
        ({"lr": 1e-3, "min_lr": -1.0}, r"`OptimizerConfig.min_lr=-1.0` must be"),
        ({"lr": 1e-3, "decoupled_lr": math.inf}, r"`OptimizerConfig.decoupled_lr=inf` must be"),
        ({"lr": 1e-3, "weight_decay": -0.1}, r"`OptimizerConfig.weight_decay=-0.1` must be"),
        ({"lr": None}, r"`OptimizerConfig.lr` is None: megatron needs a learning rate"),
    ],
)
def test_bad_learning_rate_or_weight_decay_raises_before_megatron(fields, match):
    with pytest.raises(ValueError, match=match):
        check_optimizer_values(OptimizerConfig(**fields))
    # build_optimizer refuses it before megatron sees the (here: absent) model chunks
    with pytest.raises(ValueError, match=match):
        build_optimizer(
            OptimizerConfig(**fields),
            [],
            clip_grad=0.0,
            bf16=False,
            use_distributed_optimizer=False,
        )


def test_learning_rate_of_the_wrong_type_raises():
    with pytest.raises(TypeError, match=r"`OptimizerConfig.lr` must be a number, got str"):
        check_optimizer_values(OptimizerConfig(lr="1e-3"))  # type: ignore[arg-type]


def test_valid_optimizer_values_pass():
    check_optimizer_values(OptimizerConfig(lr=0.0, min_lr=0.0, weight_decay=0.0))
    check_optimizer_values(OptimizerConfig(lr=5e-3, min_lr=None, weight_decay=0.01))


def test_strategy_installs_the_one_traceback_hook_for_any_script(monkeypatch):
    """Not only ``lmrl``: a user script's ``Trainer.fit`` gets the rank-0-only traceback hook
    from ``MCoreRLStrategy.setup_environment`` (after torch.distributed installs its own)."""
    import sys

    from lightning.pytorch import Callback

    from lightning_mcore_rl.rank_errors import RankExceptHook
    from lightning_mcore_rl.testing import destroy_megatron_state

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # restored after the test
    seen: list[object] = []

    class Probe(Callback):
        def on_fit_start(self, trainer, pl_module):
            seen.append(sys.excepthook)

    trainer = cpu_trainer(strategy=MCoreRLStrategy(), max_steps=1, callbacks=[Probe()])
    try:
        trainer.fit(SFTModule(), datamodule=SFTDataModule(num_steps=1))
    finally:
        destroy_megatron_state()
    assert len(seen) == 1 and isinstance(seen[0], RankExceptHook)  # outermost: wraps torch's
