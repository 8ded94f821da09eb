"""Precision plugin: megatron owns dtypes, backward and gradient clipping."""

# Lightning's generic precision plugins would run the backward a second time, clip the (empty)
# `.grad` of local shards and set the default dtype while `configure_model` runs. Under megatron
# the schedule already ran the backward inside `training_step`, gradients live in the DDP
# `main_grad` buffers until `MegatronOptimizer.step` clips them globally, and dtypes belong to the
# `TransformerConfig`/`OptimizerConfig` (bf16 params in `Float16Module`, fp32 main params).

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from typing_extensions import override

from lightning_mcore_rl.strategy.config import SUPPORTED_PRECISION, PrecisionFlag


class MCorePrecision(Precision):
    """Lightning precision flag -> megatron dtypes; `backward` and `clip_gradients` are no-ops.

    Args:
        precision: `"32-true"`, `"bf16-mixed"` (bf16 params, fp32 grad reduction) or `"bf16-true"`.
    """

    # bf16-true differs from bf16-mixed only in reducing gradients in bf16: megatron's optimizer
    # always keeps fp32 main params

    def __init__(self, precision: PrecisionFlag = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"MCoreRLStrategy supports precision {list(SUPPORTED_PRECISION)}, got "
                f"{precision!r}; fp16 with loss scaling and fp8 are not supported yet."
            )
        self.precision = precision

    @property
    def bf16(self) -> bool:
        """Whether megatron runs the model in bf16."""
        return self.precision != "32-true"

    @property
    def params_dtype(self) -> torch.dtype:
        """`TransformerConfig.params_dtype` / `pipeline_dtype` for this precision."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @override
    def backward(
        self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """No-op: megatron's schedule ran forward AND backward inside `training_step`."""

    # `Trainer(gradient_clip_val)` is mapped to `OptimizerConfig.clip_grad`; megatron clips by the
    # global norm inside `MegatronOptimizer.step` (no parameter has a `.grad` here: gradients are
    # still in the DDP `main_grad` buffers)
    @override
    def clip_gradients(
        self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        """No-op: megatron clips inside `MegatronOptimizer.step`."""


def to_mcore_precision(plugin: Precision) -> MCorePrecision:
    """Translate the plugin Lightning's connector built from `Trainer(precision=...)`.

    Raises:
        ValueError: a precision megatron cannot run here (`"64-true"`, `"16-mixed"`,
            Transformer Engine, bitsandbytes, ...)."""
    # "16-mixed" (fp16 needs megatron's loss scaling, not supported) raises wherever it reaches
    # the strategy; on CPU Lightning's connector already replaced it with "bf16-mixed" (its own
    # warning) and left no public trace of the original flag
    if isinstance(plugin, MCorePrecision):
        return plugin
    flag = getattr(plugin, "precision", None)
    if flag in ("16", "16-mixed"):
        raise ValueError(
            f"MCoreRLStrategy supports precision {list(SUPPORTED_PRECISION)}, got {flag!r}: "
            "fp16 with loss scaling is not supported; use `Trainer(precision='bf16-mixed')`."
        )
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision) and flag in SUPPORTED_PRECISION:
        return MCorePrecision(flag)
    raise ValueError(
        f"MCoreRLStrategy supports precision {list(SUPPORTED_PRECISION)}, got {flag!r} "
        f"({type(plugin).__name__}); pass one of those to `Trainer(precision=...)`."
    )
