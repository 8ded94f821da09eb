"""An RMSNorm whose backward keeps only its input, without Transformer Engine or Apex, and the
local spec's norm `LocalNorm`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.models.layers.row_blocks import row_slices


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# megatron's local spec normalises with `WrappedTorchNorm`, i.e. `torch.nn.RMSNorm`, whose composite
# autograd keeps, beside the norm's output, the input upcast to fp32 and the fp32 normalised input.
# This function runs torch's composite forward op for op (bitwise) and keeps only the input and the
# fp32 reciprocal RMS
class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        upcast = x.to(_opmath(x.dtype))
        rstd = torch.rsqrt(torch.pow(upcast, 2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return upcast.mul(rstd).mul(weight).type_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        """`dx = rstd * (g w - x_hat mean(g w x_hat))`, `dw = sum(g x_hat)` over rows, with
        `x_hat = x rstd`, all in fp32."""
        x, rstd, weight = ctx.saved_tensors
        width = x.shape[-1]
        rows_x, rows_grad = x.reshape(-1, width), grad.reshape(-1, width)
        rows_rstd = rstd.reshape(-1, 1)
        dx = torch.empty_like(rows_x)
        dw = torch.zeros(width, dtype=torch.float32, device=x.device)
        w = weight.float()
        # blocks of rows in fp32 (`row_blocks`): the temporaries stay small at the step's peak
        for rows in row_slices(rows_x.shape[0], width, x.device):
            r = rows_rstd[rows].float()
            x_hat = rows_x[rows].float() * r
            g = rows_grad[rows].float()
            dw += (g * x_hat).sum(dim=0)
            gw = g * w
            dx[rows] = (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True)).mul_(r)
        return dx.view_as(x), dw.to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of `x [..., H]` with `weight [H]`: `torch.nn.functional.rms_norm`'s value (bitwise);
    the backward keeps `x` and the `[..., 1]` reciprocal RMS."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """`torch.nn.RMSNorm` over the last dimension (`weight` ones at init) through `rms_norm`, built
    like megatron's norms (`config, hidden_size, eps`); raises `ValueError` for
    `layernorm_zero_centered_gamma`."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if config.layernorm_zero_centered_gamma:
            raise ValueError(
                "RMSNorm does not support `TransformerConfig.layernorm_zero_centered_gamma=True`"
            )
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        # under sequence parallelism megatron all-reduces a `sequence_parallel` weight's gradient
        # over TP, as for Transformer Engine's norm
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: Tensor) -> Tensor:
        """`[..., H] -> [..., H]`."""
        return rms_norm(x, self.weight, self.eps)


class LocalNorm:
    """The local spec's norm: `RMSNorm` for `config.normalization == "RMSNorm"`, else megatron's
    `WrappedTorchNorm` (LayerNorm, L2Norm), with the same arguments."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return WrappedTorchNorm(config, hidden_size, eps, **kwargs)


__all__ = ["LocalNorm", "RMSNorm", "rms_norm"]
