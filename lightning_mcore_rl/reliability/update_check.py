"""An optimizer update verified after it runs, and undone when it fails (trainer-free): megatron's
update runs between `UpdateSnapshot.take` and `update_measures`; a failing one is undone
bitwise by `UpdateSnapshot.restore`."""

# The fallback of the update check: torch's Adam/AdamW/SGD updates are verified before they run
# (update_preview.py, no copy); any other inner optimizer (Transformer Engine's or Apex's fused
# Adam) is checked here, at the cost of one copy of the parameters and optimizer state
# (docs/reliability.md). Failing: a NaN/inf weight or state entry anywhere (an overflowing lr, a
# corrupt Adam moment, bf16 overflow), or an update above `max_update_ratio` x the parameters'
# norm (lr=1e8 makes finite but useless weights whose next forward overflows). Undone, it is
# neither saved nor used by a rollout.

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def optimizer_members(optimizer: Any) -> list[Any]:
    """Megatron's optimizer members (a ``ChainedOptimizer``'s, else itself), stubs left out."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return [m for m in members if not getattr(m, "is_stub_optimizer", False)]


@dataclass
class UpdateSnapshot:
    """What an update writes, copied before it."""

    params: list[Tensor]  # the model parameters (their copies come first in `copies`)
    # `params`, then the members' main parameters not among them (fp32 copies of bf16 weights,
    # distributed-optimizer shards)
    tensors: list[Tensor]
    copies: list[Tensor]  # a clone of each of `tensors`
    # per member: its torch optimizer's `state` mapping and a copy (tensors cloned; entries the
    # update creates, e.g. at the first step, are removed on restore)
    states: list[tuple[Any, dict[Any, dict[str, Any]]]]

    @classmethod
    def take(cls, optimizer: Any, params: Sequence[Tensor]) -> UpdateSnapshot:
        """Copy ``params`` and what megatron's ``optimizer`` updates."""
        tensors = list(params)
        seen = {id(p) for p in tensors}
        states = []
        for member in optimizer_members(optimizer):
            inner = member.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        tensors.append(p)
            saved = {p: {k: _copy(v) for k, v in s.items()} for p, s in inner.state.items()}
            states.append((inner.state, saved))
        with torch.no_grad():
            copies = [t.detach().clone() for t in tensors]
        return cls(list(params), tensors, copies, states)

    def restore(self) -> None:
        """Every tensor and optimizer-state entry bitwise as when taken (in place)."""
        with torch.no_grad():
            for live, saved in zip(self.tensors, self.copies, strict=True):
                live.copy_(saved)
            for state, saved_state in self.states:
                for p in [p for p in state if p not in saved_state]:
                    del state[p]
                for p, saved_entries in saved_state.items():
                    entries = state[p]
                    for key in [k for k in entries if k not in saved_entries]:
                        del entries[key]
                    for key, value in saved_entries.items():
                        current = entries.get(key)
                        if isinstance(value, Tensor) and isinstance(current, Tensor):
                            current.copy_(value)
                        else:
                            entries[key] = _copy(value)

    def state_tensors(self) -> list[Tensor]:
        """The live optimizer-state tensors (after the update)."""
        return [
            v
            for state, _ in self.states
            for entries in state.values()
            for v in entries.values()
            if isinstance(v, Tensor)
        ]


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


_DIFFERENCE_CHUNK = 1 << 24
"""Elements per piece of :func:`_difference_norms`' scratch buffer (64 MiB in fp32)."""


def update_measures(
    snapshot: UpdateSnapshot, device: torch.device | str, group: Any
) -> tuple[float, float, float]:
    """After the update: `(non-finite tensors, ||update||, ||parameters before||)` over every
    rank (ONE all-reduce SUM of three float64 numbers over `group`)."""
    # A tensor counts when a sum over it overflows (NaN/inf entries, or huge ones): a model
    # parameter when the norm of its change is not finite, every other tensor (main parameters,
    # optimizer state) when its sum is not. The norms are over the model parameters, replicated
    # copies counted once per rank (their ratio still measures the update's relative size), in
    # fp32; a norm that overflows is inf, which fails too.
    params = [p.detach() for p in snapshot.params]
    before = snapshot.copies[: len(params)]
    others = snapshot.tensors[len(params) :] + snapshot.state_tensors()
    checked = [t.detach().sum().float() for t in others if t.numel()]  # NaN/inf propagate
    numbers = torch.zeros(3, dtype=torch.float64, device=device)
    if params:
        changes = _difference_norms(params, before)
        checked.append(changes)
        numbers[1] = changes.double().square().sum().to(numbers)
        norms = torch._foreach_norm(before, 2, torch.float32)
        numbers[2] = torch.stack(norms).double().square().sum().to(numbers)
    if checked:
        flat = torch.cat([x.reshape(-1) for x in checked])
        numbers[0] = (~torch.isfinite(flat)).sum().to(numbers)
    return reduce_measures(numbers, group)


def reduce_measures(numbers: Tensor, group: Any) -> tuple[float, float, float]:
    """`numbers` (`[3]` float64: non-finite tensors, ||update||^2, ||parameters||^2) summed over
    `group` (ONE all-reduce) -> `(count, ||update||, ||parameters||)`."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(numbers, op=dist.ReduceOp.SUM, group=group)
    count, delta_sq, norm_sq = numbers.cpu().tolist()
    return count, math.sqrt(delta_sq), math.sqrt(norm_sq)


@torch.no_grad()
def _difference_norms(
    after: Sequence[Tensor], before: Sequence[Tensor], chunk: int = _DIFFERENCE_CHUNK
) -> Tensor:
    """`[len(after)]` fp32 norms `||after_i - before_i||`, through ONE scratch buffer of at most
    `chunk` elements per dtype and device."""
    # not a fresh copy of every difference: that is one more copy of the parameters at the
    # optimizer step's peak
    scratch: dict[tuple[torch.dtype, torch.device], Tensor] = {}
    norms = []
    for a, b in zip(after, before, strict=True):
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        size = min(flat_a.numel(), chunk)
        buffer = scratch.get((a.dtype, a.device))
        if buffer is None or buffer.numel() < size:
            buffer = scratch[(a.dtype, a.device)] = torch.empty(
                size, dtype=a.dtype, device=a.device
            )
        pieces = []
        for start in range(0, flat_a.numel(), chunk):
            end = min(start + chunk, flat_a.numel())
            piece = torch.sub(flat_a[start:end], flat_b[start:end], out=buffer[: end - start])
            pieces.append(torch.linalg.vector_norm(piece, dtype=torch.float32))
        norms.append(
            torch.linalg.vector_norm(torch.stack(pieces))
            if pieces
            else a.new_zeros((), dtype=torch.float32)
        )
    return torch.stack(norms) if norms else torch.zeros(0)


def update_failure(
    measures: tuple[float, float, float], max_update_ratio: float | None
) -> str | None:
    """Why an update with `update_measures` `measures` fails, or `None`."""
    count, delta, norm = measures
    # a NaN update norm counts as non-finite; the ratio needs a positive parameters' norm
    if count > 0 or not math.isfinite(delta):
        return (
            f"non-finite weights or optimizer state after the update ({int(count)} tensors "
            "with NaN/inf over all ranks)"
        )
    if max_update_ratio is not None and norm > 0 and delta > max_update_ratio * norm:
        return (
            f"an update of norm {delta:.3g}, {delta / norm:.3g} times the parameters' norm "
            f"{norm:.3g} (max_update_ratio={max_update_ratio:g}): the learning rate overflows"
        )
    return None


__all__ = [
    "UpdateSnapshot",
    "optimizer_members",
    "reduce_measures",
    "update_failure",
    "update_measures",
]
