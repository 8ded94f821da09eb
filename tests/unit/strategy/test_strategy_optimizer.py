"""The megatron optimizer facade and the OptimizerConfig fields the Trainer/strategy own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_mcore_rl.strategy import MegatronOptimizerAdapter
from lightning_mcore_rl.strategy.optimizer import resolve_optimizer_config


class _FakeMegatronOptimizer:
    """The parts of megatron's optimizer ``megatron_step`` calls: 2 param groups,
    ``prepare_grads -> found_inf``, ``get_grad_norm``, ``step_with_ready_grads -> ok``."""

    def __init__(self, grad_norm: float = 2.5) -> None:
        self.param_groups = [{"lr": 1.0, "params": []}, {"lr": 1.0, "params": []}]
        self.state: dict = {}
        self.config = SimpleNamespace(clip_grad=0.0, log_num_zeros_in_grad=False)
        self.grad_norm = grad_norm
        self.steps = 0

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return self.grad_norm

    def step_with_ready_grads(self) -> bool:
        self.steps += 1
        return True


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


def test_a_nonfinite_megatron_grad_norm_skips_the_update():
    from lightning_mcore_rl.reliability.nonfinite import NonFiniteGuard

    mopt = _FakeMegatronOptimizer(grad_norm=float("nan"))
    adapter = MegatronOptimizerAdapter(mopt)
    guard = NonFiniteGuard("skip")
    adapter.use_guard(guard)
    guard.begin_step()
    with pytest.warns(UserWarning, match="megatron's global grad norm: nan"):
        adapter.step()
    assert mopt.steps == 0 and guard.skipped_steps == 1 and guard.step_skipped
    assert not adapter.last_step.update_successful


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
        ValueError,
        match=r"set `MCoreRLStrategy\(ddp=MegatronDDPConfig\(use_distributed_optimizer=True\)\)`",
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
