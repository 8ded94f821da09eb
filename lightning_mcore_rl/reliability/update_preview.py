"""An optimizer update verified before it is applied, with no copy of the state (trainer-free):
`preview_measures` computes what torch's `Adam`/`AdamW`/`SGD` WOULD write, block by block into
scratch tensors, and returns `update_check.update_measures`' `(non-finite tensors, ||update||,
||parameters||)` (ONE all-reduce), so a failing update is never run."""

# Those three are the inner optimizers megatron-core builds without Transformer Engine or Apex;
# the preview applies torch's formulas to the prepared and clipped gradients with the group's
# hyperparameters (lr, betas, eps, weight_decay, amsgrad, maximize, AdamW's decoupled decay, SGD's
# momentum/dampening/nesterov). Against `UpdateSnapshot` it saves the copy of the parameters and
# optimizer state (14 bytes per parameter under bf16-mixed with Adam) for one block's scratch
# (`block_elements`) and one more pass of the arithmetic. The norms are the main parameters'
# (fp32 under bf16-mixed; distributed-optimizer shards), which megatron copies to the model after
# the update. Any other inner optimizer (TE/Apex fused Adam, megatron's CPU-offloading
# `HybridDeviceOptimizer`, a subclass) is not `previewable`: the check falls back to the snapshot.

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.reliability.update_check import optimizer_members, reduce_measures

_CPU_BLOCK = 1 << 16
"""Elements per block on CPU: a block's dozen scratch tensors (256 KiB each in fp32) stay in the
cache. 44.6M fp32 parameters, one thread (``benchmarks/update_check.py``): 0.15 s per preview at
65536 elements, 0.30 s at 4M."""

_DEVICE_BLOCK = 1 << 24
"""Elements per block on an accelerator, where each block costs a dozen kernel launches: 64 MiB
per fp32 scratch tensor, ~430 blocks for 7B parameters."""


def block_elements(device: torch.device | str) -> int:
    """Elements of a parameter previewed at once on ``device``."""
    return _CPU_BLOCK if torch.device(device).type == "cpu" else _DEVICE_BLOCK


_PREVIEWED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def previewable(optimizer: Any) -> bool:
    """Whether every member's inner optimizer is exactly torch's `Adam`, `AdamW` or `SGD` over
    real parameters."""
    # the same answer on every rank: it depends on the optimizer config only
    for member in optimizer_members(optimizer):
        inner: Any = getattr(member, "optimizer", None)
        if type(inner) not in _PREVIEWED:
            return False
        if any(p.is_complex() for g in inner.param_groups for p in g["params"]):
            return False
    return True


def preview_measures(
    optimizer: Any, device: torch.device | str, group: Any, block: int | None = None
) -> tuple[float, float, float]:
    """Before the update: `(non-finite tensors, ||update||, ||parameters||)` it would give over
    every rank (ONE all-reduce SUM of three float64 numbers over `group`).

    Raises:
        ValueError: `optimizer` is not `previewable`.
    """
    # counted as in `update_measures`; parameters without a gradient are not updated (torch
    # skips them) and add only to ||parameters||
    if not previewable(optimizer):
        raise ValueError("preview_measures needs torch Adam/AdamW/SGD inner optimizers")
    block = block_elements(device) if block is None else block
    norms: list[Tensor] = []  # ||p||, every parameter
    deltas: list[Tensor] = []  # ||update of p||, every parameter with a gradient
    sums: list[Tensor] = []  # the sum of each new state tensor
    with torch.no_grad():
        for member in optimizer_members(optimizer):
            inner = member.optimizer
            for options in inner.param_groups:
                for p in options["params"]:
                    _preview_param(inner, options, p, block, norms, deltas, sums)
        numbers = torch.zeros(3, dtype=torch.float64, device=device)
        if deltas:
            changes = torch.stack(deltas)
            checked = torch.cat([changes, torch.stack(sums)]) if sums else changes
            numbers[0] = (~torch.isfinite(checked)).sum().to(numbers)
            numbers[1] = changes.double().square().sum().to(numbers)
        if norms:
            numbers[2] = torch.stack(norms).double().square().sum().to(numbers)
    return reduce_measures(numbers, group)


def _preview_param(
    inner: Any,
    options: dict[str, Any],
    p: Tensor,
    block: int,
    norms: list[Tensor],
    deltas: list[Tensor],
    sums: list[Tensor],
) -> None:
    """Append `||p||` to `norms` and, when `p` has a gradient, the norm of its update to `deltas`
    and the sum of each of its new state tensors to `sums` (fp32 scalars)."""
    flat = p.detach().reshape(-1)
    grad = None if p.grad is None else p.grad.detach().reshape(-1)
    state = inner.state.get(p, {})
    rule = _sgd_block if isinstance(inner, torch.optim.SGD) else _adam_block
    block_norms: list[Tensor] = []
    block_deltas: list[Tensor] = []
    block_sums: list[list[Tensor]] = []
    for start in range(0, max(flat.numel(), 1), block):
        where = slice(start, min(start + block, flat.numel()))
        block_norms.append(torch.linalg.vector_norm(flat[where], dtype=torch.float32))
        if grad is None:
            continue
        delta, new_state = rule(flat[where], grad[where], state, where, options, inner)
        block_deltas.append(torch.linalg.vector_norm(delta, dtype=torch.float32))
        block_sums.append([t.sum(dtype=torch.float32) for t in new_state])
    norms.append(_combined(block_norms))
    if block_deltas:
        deltas.append(_combined(block_deltas))
        sums.extend(torch.stack(column).sum() for column in zip(*block_sums, strict=True))


def _combined(norms: list[Tensor]) -> Tensor:
    """The norm of a tensor from the norms of its blocks."""
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def _state_block(state: dict[str, Any], key: str, where: slice) -> Tensor | None:
    value = state.get(key)
    return None if value is None else value.reshape(-1)[where]


def _adam_block(
    p: Tensor, g: Tensor, state: dict[str, Any], where: slice, options: dict[str, Any], inner: Any
) -> tuple[Tensor, list[Tensor]]:
    """`(new - old value, [new exp_avg, new exp_avg_sq(, new max_exp_avg_sq)])` of one block of
    a parameter: torch's `Adam`/`AdamW` step (`_single_tensor_adam`'s formulas)."""
    lr, (beta1, beta2) = float(options["lr"]), options["betas"]
    decay = options["weight_decay"]
    step = float(state["step"]) + 1.0 if "step" in state else 1.0
    if options.get("maximize", False):
        g = -g
    new_p = p
    if decay != 0:
        if isinstance(inner, torch.optim.AdamW) or options.get("decoupled_weight_decay", False):
            new_p = p * (1.0 - lr * decay)
        else:
            g = g.add(p, alpha=decay)
    exp_avg = _state_block(state, "exp_avg", where)
    exp_avg_sq = _state_block(state, "exp_avg_sq", where)
    m = torch.lerp(torch.zeros_like(p) if exp_avg is None else exp_avg, g, 1.0 - beta1)
    v = (torch.zeros_like(p) if exp_avg_sq is None else exp_avg_sq).mul(beta2)
    v.addcmul_(g, g, value=1.0 - beta2)
    new_state = [m, v]
    second = v
    if options.get("amsgrad", False):
        previous = _state_block(state, "max_exp_avg_sq", where)
        second = v if previous is None else torch.maximum(previous, v)
        new_state.append(second)
    denom = torch.sqrt(second).div_(math.sqrt(1.0 - beta2**step)).add_(options["eps"])
    step_size = lr / (1.0 - beta1**step)
    return torch.addcdiv(new_p, m, denom, value=-step_size).sub_(p), new_state


def _sgd_block(
    p: Tensor, g: Tensor, state: dict[str, Any], where: slice, options: dict[str, Any], _: Any
) -> tuple[Tensor, list[Tensor]]:
    """`(new - old value, [new momentum_buffer] or [])` of one block of a parameter (torch's
    `SGD`)."""
    lr, decay, momentum = float(options["lr"]), options["weight_decay"], options["momentum"]
    if options.get("maximize", False):
        g = -g
    if decay != 0:
        g = g.add(p, alpha=decay)
    new_state = []
    if momentum != 0:
        previous = _state_block(state, "momentum_buffer", where)
        if previous is None:
            buf = g.clone()
        else:
            buf = previous.mul(momentum).add_(g, alpha=1.0 - options["dampening"])
        new_state.append(buf)
        g = g.add(buf, alpha=momentum) if options["nesterov"] else buf
    return torch.add(p, g, alpha=-lr).sub_(p), new_state


__all__ = ["block_elements", "preview_measures", "previewable"]
