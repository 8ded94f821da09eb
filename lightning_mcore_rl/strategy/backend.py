"""The run-scoped backends the strategy enters in `setup_environment` and leaves in `teardown`."""

from __future__ import annotations

import contextlib
import importlib.util


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` is importable (megatron then needs none of the fixes)."""
    return importlib.util.find_spec("transformer_engine") is not None


def enter_run_backends(stack: contextlib.ExitStack, device_type: str) -> None:
    """Enter, on `stack`, `megatron_compat` when Transformer Engine is absent and `cpu_emulation`
    when `device_type == "cpu"`."""
    # on any device: a GPU run without TE needs the same no-TE/Apex fixes
    from lightning_mcore_rl._compat import megatron_compat

    if not transformer_engine_available():
        stack.enter_context(megatron_compat())
    if device_type == "cpu":
        from lightning_mcore_rl.cpu import cpu_emulation

        stack.enter_context(cpu_emulation())


__all__ = ["enter_run_backends", "transformer_engine_available"]
