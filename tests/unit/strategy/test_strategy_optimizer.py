"""The megatron optimizer facade and the OptimizerConfig fields the Trainer/strategy own."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.strategy import MegatronOptimizerAdapter
from lightning_mcore_rl.strategy.optimizer import resolve_optimizer_config


class _FakeMegatronOptimizer:
    """Megatron's optimizer API: 2 param groups, ``step() -> (ok, grad_norm, num_zeros)``."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 1.0, "params": []}, {"lr": 1.0, "params": []}]
        self.state: dict = {}
        self.steps = 0

    def step(self):
        self.steps += 1
        return True, 2.5, None


def test_adapter_runs_closure_then_megatron_step_and_drives_torch_schedulers():
    mopt = _FakeMegatronOptimizer()
    adapter = MegatronOptimizerAdapter(mopt)
    assert isinstance(adapter, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adapter, lambda s: 0.5**s)
    calls = []
    assert adapter.step(lambda: calls.append("closure") or 7.0) == 7.0
    assert calls == ["closure"] and mopt.steps == 1
    assert adapter.last_step.grad_norm == 2.5 and adapter.last_step.update_successful
    scheduler.step()
    assert [g["lr"] for g in mopt.param_groups] == [0.5, 0.5]  # both megatron groups
    adapter.zero_grad()  # no-op by design


def test_adapter_record_is_shared_with_lightning_optimizer_wrapper():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    adapter = MegatronOptimizerAdapter(_FakeMegatronOptimizer())
    wrapper = LightningOptimizer(adapter)
    adapter.step()
    assert wrapper.last_step is adapter.last_step


def test_owned_optimizer_fields_are_filled_or_conflicts_raise():
    from megatron.core.optimizer import OptimizerConfig

    config = resolve_optimizer_config(
        OptimizerConfig(lr=1e-3), clip_grad=0.0, bf16=True, use_distributed_optimizer=True
    )
    assert (config.clip_grad, config.bf16, config.use_distributed_optimizer) == (0.0, True, True)
    assert config.params_dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"`OptimizerConfig.clip_grad=0.3` conflicts"):
        resolve_optimizer_config(
            OptimizerConfig(clip_grad=0.3),
            clip_grad=0.0,
            bf16=False,
            use_distributed_optimizer=False,
        )
    with pytest.raises(ValueError, match=r"`OptimizerConfig.bf16=True` conflicts"):
        resolve_optimizer_config(
            OptimizerConfig(bf16=True), clip_grad=0.0, bf16=False, use_distributed_optimizer=False
        )
    with pytest.raises(ValueError, match="`OptimizerConfig.fp16=True` is not supported"):
        resolve_optimizer_config(
            OptimizerConfig(fp16=True), clip_grad=0.0, bf16=False, use_distributed_optimizer=False
        )
    with pytest.raises(
        ValueError, match="set `MCoreRLStrategy\\(use_distributed_optimizer=True\\)`"
    ):
        resolve_optimizer_config(
            OptimizerConfig(use_distributed_optimizer=True),
            clip_grad=0.0,
            bf16=False,
            use_distributed_optimizer=False,
        )
    with pytest.raises(TypeError, match="must return a megatron `OptimizerConfig`"):
        resolve_optimizer_config(
            {"lr": 1.0}, clip_grad=0.0, bf16=False, use_distributed_optimizer=False
        )
