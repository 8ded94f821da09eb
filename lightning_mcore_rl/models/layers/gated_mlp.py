"""A SwiGLU MLP whose backward keeps only the first linear's output, without Transformer Engine."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mcore_rl.models.layers.row_blocks import row_slices


# megatron's unfused gated MLP (the local spec's path on CPU and on a GPU without TE) computes
# silu(gate) * (up + glu_linear_offset) op by op, so autograd keeps, beside linear_fc1's output [s,
# b, 2F], the silu(gate) output and the up + 0.0 copy ([s, b, F] each). This function keeps only
# linear_fc1's output and recomputes the sigmoid in its backward; the forward is bitwise megatron's
class _SwiGLUFunction(torch.autograd.Function):
    """`[..., 2F] -> [..., F]`: `silu(x[..., :F]) * x[..., F:]`, keeping only `x`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        """`[..., F] -> [..., 2F]` in blocks of rows, in fp32, rounded once to `x`'s dtype."""
        (x,) = ctx.saved_tensors
        width = x.shape[-1] // 2
        rows_x, rows_grad = x.reshape(-1, 2 * width), grad.reshape(-1, width)
        out = torch.empty_like(rows_x)
        for rows in row_slices(rows_x.shape[0], width, x.device):
            # blocks of rows in fp32 (`row_blocks`): the temporaries stay small at the step's peak
            gate, up = torch.chunk(rows_x[rows].float(), 2, dim=-1)
            g = rows_grad[rows].float()
            sigmoid = torch.sigmoid(gate)
            out[rows, width:] = F.silu(gate).mul_(g)
            # torch's silu backward: dy * sigmoid * (1 + x * (1 - sigmoid)), dy = grad * up
            out[rows, :width] = (g * up).mul_(sigmoid).mul_(gate * (1 - sigmoid) + 1)
        return out.view_as(x)


def swiglu(x: Tensor) -> Tensor:
    """SwiGLU of `x [..., 2F]` (gate half first, megatron's `linear_fc1` layout, also per TP shard)
    -> `[..., F]`; its backward keeps only `x`. Raises `ValueError` for an odd last dim."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension (gate and up), got {x.shape}")
    return _SwiGLUFunction.apply(x)


class SwiGLU(MegatronModule):
    """`swiglu` as the module `MLPSubmodules.activation_func` builds (`config=`); no parameters."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)

    def forward(self, x: Tensor) -> Tensor:
        """`[..., 2F] -> [..., F]`."""
        return swiglu(x)


def lean_swiglu_applies(config: Any) -> bool:
    """Whether `config`'s MLP is a plain SwiGLU that megatron would run unfused: gated, silu, no
    bias-activation fusion, no TE activation, no clamp, `glu_linear_offset` 0."""
    return bool(
        config.gated_linear_unit
        and config.activation_func is F.silu
        # megatron's fused bias-activation kernel keeps only its input already
        and not config.bias_activation_fusion
        and not config.use_te_activation_func
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
        and not config.activation_func_fp8_input_store
    )


# in a layer spec it stands where megatron's dense `MLP` stood (`_compat.replace_dense_mlp`): the
# class before megatron-core 0.19, built on megatron's global TP group;
# `partial(GatedMLP.as_mlp_submodule, ...)` from 0.19, built with the layer's TP group
class GatedMLP(MLP):
    """megatron's `MLP` with `SwiGLU` as its activation where `lean_swiglu_applies` (else exactly
    megatron's `MLP`): same parameters, checkpoint keys and forward; the local spec's linear layers
    (`local_submodules`) by default."""

    @staticmethod
    def local_submodules() -> MLPSubmodules:
        """The local spec's MLP linear layers (megatron's own, no Transformer Engine)."""
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def __init__(
        self, config: Any, submodules: MLPSubmodules | None = None, *args: Any, **kwargs: Any
    ) -> None:
        submodules = self.local_submodules() if submodules is None else submodules
        if lean_swiglu_applies(config):
            # megatron's own extension point: `MLPSubmodules.activation_func` (a module applied to
            # the whole linear_fc1 output), which `MLP` uses under `config.use_te_activation_func`
            config = copy.copy(config)  # this module's own view; the model's config unchanged
            config.use_te_activation_func = True
            submodules = dataclasses.replace(submodules, activation_func=SwiGLU)
        else:
            submodules = dataclasses.replace(submodules, activation_func=None)
        super().__init__(config, submodules, *args, **kwargs)


__all__ = ["GatedMLP", "SwiGLU", "lean_swiglu_applies", "swiglu"]
