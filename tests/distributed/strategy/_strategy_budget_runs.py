"""Rank functions for ``MCoreRLStrategy(max_tokens_per_microbatch=...)`` on the ``loss_fn`` path:
the same ClippedPG GRPO run under a Trainer with fixed-size and with token-budget microbatches, in
one rank process (same weights, same sampler order), padded and packed."""

from __future__ import annotations

import os
from typing import Any

import torch
from _strategy_packing_runs import PackedGRPOModule, fit_recorded
from _strategy_rl_runs import RolloutRows
from _strategy_runs import VOCAB


class SkewedRows(RolloutRows):
    """Even rows (data-parallel rank 0 with DP=2) are short (6..8 tokens), odd rows (rank 1) long
    (12..16): the ranks' token-budget plans differ in microbatch count before balancing."""

    def __init__(self, num_rows: int) -> None:
        super().__init__(num_rows)
        i = torch.arange(num_rows)
        self.lengths = torch.where(i % 2 == 0, 6 + (i // 2) % 3, 12 + (i // 2) % 5)
        positions = torch.arange(self.ids.shape[1])[None, :]
        real = positions < self.lengths[:, None]
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, self.ids.shape, generator=g) * real
        self.token_mask = (real & (positions >= 3)).float()


class BudgetGRPOModule(PackedGRPOModule):
    """Records the number of microbatches each training step ran (this DP rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_microbatches: list[int] = []

    def training_step(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        out = self.forward_backward(batch)
        self.num_microbatches.append(len(out.microbatch_losses))
        metrics = {f"train_{k}": v for k, v in out.metrics.items()}
        self.log_dict({"train_loss": out.loss, **metrics}, batch_size=1, prog_bar=False)
        return out.loss


def _fit(spec: dict[str, Any], world_size: int, packing: bool, budget: int | None) -> dict:
    module = BudgetGRPOModule()
    rows = SkewedRows(spec["rows"])
    run = fit_recorded(spec, world_size, module, rows, packing=packing, budget=budget)
    return {**run, "num_microbatches": module.num_microbatches}


def budget_rank(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Per layout in ``spec["layouts"]`` (``"padded"``/``"packed"``): a fixed-size fit and a
    token-budget fit; then the error of a budget below the shortest row (every rank raises)."""
    world_size = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {}
    for layout in spec["layouts"]:
        packing = layout == "packed"
        out[layout] = {
            "fixed": _fit(spec, world_size, packing, None),
            "budget": _fit(spec, world_size, packing, spec["budget"]),
        }
    try:
        _fit({**spec, "steps": 1}, world_size, packing=True, budget=5)
        out["error"] = ""
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["error"] = f"{type(err).__name__}: {err}"
    return out
