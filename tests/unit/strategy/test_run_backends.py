"""The run's backends: megatron's no-TE/Apex fixes on every device that lacks Transformer Engine
(a GPU run without TE included), the CPU emulation only on CPU; both left on close."""

from __future__ import annotations

import contextlib

import pytest
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from lightning_mcore_rl import _compat
from lightning_mcore_rl.cpu import emulation
from lightning_mcore_rl.strategy import backend

ORIGINAL_NEW = WrappedTorchNorm.__dict__["__new__"]
ORIGINAL_SET = DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"]


def _patched() -> tuple[bool, bool]:
    return (
        WrappedTorchNorm.__dict__["__new__"] is not ORIGINAL_NEW,
        DistributedOptimizer.__dict__["_set_main_param_and_optimizer_states"] is not ORIGINAL_SET,
    )


def test_without_te_a_gpu_run_gets_the_fixes_and_no_cpu_backend(monkeypatch) -> None:
    monkeypatch.setattr(backend, "transformer_engine_available", lambda: False)
    assert _patched() == (False, False)
    with contextlib.ExitStack() as stack:
        backend.enter_run_backends(stack, "cuda")  # the CPU backend stays off
        assert _patched() == (True, True)
        assert _compat._COMPAT.active
        assert not emulation._STATE.active  # no CPU backend
    assert _patched() == (False, False)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_with_te_only_the_cpu_backend_is_entered(monkeypatch, device: str) -> None:
    monkeypatch.setattr(backend, "transformer_engine_available", lambda: True)
    with contextlib.ExitStack() as stack:
        backend.enter_run_backends(stack, device)
        # the CPU emulation itself installs the fixes (it needs them); a TE GPU run does not
        assert _patched() == ((True, True) if device == "cpu" else (False, False))
        assert emulation._STATE.active == (device == "cpu")
    assert _patched() == (False, False)


def test_the_strategy_enters_the_run_backends_in_setup_environment() -> None:
    import inspect

    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy

    source = inspect.getsource(MCoreRLStrategy.setup_environment)
    assert "enter_run_backends(self._backend, self.root_device.type)" in source
