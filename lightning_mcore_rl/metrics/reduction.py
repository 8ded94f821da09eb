"""Rule-based reductions on torchmetrics: per-step statistics, validation aggregations."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric

Combine = Literal["sum", "min", "max"]

AGGREGATIONS: dict[str, type[Metric]] = {
    "sum": SumMetric,
    "mean": MeanMetric,
    "min": MinMetric,
    "max": MaxMetric,
}
"""The torchmetrics aggregation of each rule name of
:data:`~lightning_mcore_rl.losses.REDUCTION_RULES` (``combine`` and ``across_batches``)."""

_IDENTITY: dict[str, float] = {"sum": 0.0, "min": math.inf, "max": -math.inf}


@functools.lru_cache(maxsize=16)
def _rule_masks(kinds: tuple[Combine, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """`(is_min, is_max)` `[n]` bool masks of `kinds` on `device`."""
    is_min = torch.tensor([k == "min" for k in kinds], dtype=torch.bool, device=device)
    is_max = torch.tensor([k == "max" for k in kinds], dtype=torch.bool, device=device)
    return is_min, is_max


def combine_rows(rows: Tensor, kinds: Sequence[Combine]) -> Tensor:
    """`[R, n]` -> `[n]`: column `j` summed, min'd or max'd over the rows by `kinds[j]`."""
    if rows.dim() != 2 or rows.shape[1] != len(kinds):
        raise ValueError(f"`rows` must have shape [R, {len(kinds)}], got {tuple(rows.shape)}")
    is_min, is_max = _rule_masks(tuple(kinds), rows.device)
    return torch.where(
        is_min, rows.min(dim=0).values, torch.where(is_max, rows.max(dim=0).values, rows.sum(dim=0))
    )


def _all_gather_same_shape(tensor: Tensor, group: Any | None = None) -> list[Tensor]:
    """All-gather `tensor` over `group` (`None`: the world) in one collective."""
    # Every rank's state has the same shape by construction; torchmetrics' default (a barrier
    # and an all-gather of the shapes first) would cost two more collectives per step.
    group = group if group is not None else torch.distributed.group.WORLD
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


class RuleReduction(Metric):
    """A vector `[n]`, each entry reduced over `process_group` by its rule, in one sync.

    Args:
        kinds: the rule of each entry (`sum`, `min` or `max`).
        process_group: the group to reduce over (`None`: the world).
        device: where the state lives (the collectives' device: CUDA under NCCL).
        sync: synchronise on `compute` (`False` for a group of one process).
    """

    # Over statistics that TP/PP ranks of one replica share, pass the data-parallel group: the
    # world group would count them several times. The training step gathers its statistics
    # itself and combines the rows with `combine_rows`, the same rules.

    full_state_update = False
    values: Tensor

    def __init__(
        self,
        kinds: Sequence[Combine],
        process_group: Any | None = None,
        device: torch.device | str = "cpu",
        sync: bool = True,
    ) -> None:
        super().__init__(
            process_group=process_group,
            dist_sync_on_step=False,
            sync_on_compute=sync,
            # the single state is all-gathered once ([world, n]), each column reduced by its rule
            dist_sync_fn=_all_gather_same_shape,
        )
        self.kinds = tuple(kinds)
        identity = torch.tensor([_IDENTITY[k] for k in self.kinds], dtype=torch.float64)
        self.add_state("values", default=identity.to(device), dist_reduce_fx=self._reduce_columns)

    def _reduce_columns(self, stacked: Tensor) -> Tensor:
        """`[world, n]` gathered states -> `[n]`: each column by its rule."""
        if stacked.dim() == 1:  # a single process: nothing was gathered
            return stacked
        return combine_rows(stacked, self.kinds)

    def update(self, values: Tensor) -> None:
        """Combine `values [n]` into the state, each entry by its rule."""
        values = values.to(self.values)
        if values.shape != self.values.shape:
            raise ValueError(
                f"`values` must have shape {tuple(self.values.shape)}, got {tuple(values.shape)}"
            )
        is_min, is_max = _rule_masks(self.kinds, self.values.device)
        combined = torch.where(
            is_min,
            torch.minimum(self.values, values),
            torch.where(is_max, torch.maximum(self.values, values), self.values + values),
        )
        self.values = combined

    def compute(self) -> Tensor:
        """The reduced `[n]` fp64 values."""
        return self.values
