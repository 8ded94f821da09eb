"""Rank functions for
``MCoreRLStrategy(microbatching=MicrobatchConfig(max_tokens_per_microbatch=...))`` on the
``loss_fn`` path: the same ClippedPG GRPO run under a Trainer with fixed-size and with token-budget
microbatches, in one rank process (same weights, same sampler order), padded and packed."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from _strategy_packing_runs import PackedGRPOModule, RecordedRun, fit_recorded
from _strategy_rl_runs import RolloutRows
from _strategy_runs import VOCAB
from helpers.distributed import RunSpec


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

    def training_step(self, batch: Any, batch_idx: int = 0) -> dict[str, Any]:
        out = self.forward_backward(batch)
        self.num_microbatches.append(len(out.microbatch_losses))
        metrics = {f"train_{k}": v for k, v in out.metrics.items()}
        self.log_dict({"train_loss": out.loss, **metrics}, batch_size=1, prog_bar=False)
        return out.as_step_result()


@dataclass(frozen=True)
class BudgetResult:
    """One rank of :func:`budget_rank`: per layout the fixed-size and the token-budget fit, and
    the error of a too-small budget."""

    fixed: dict[str, RecordedRun]
    budget: dict[str, RecordedRun]
    error: str


def _fit(spec: RunSpec, world_size: int, packing: bool, budget: int | None) -> RecordedRun:
    module = BudgetGRPOModule()
    rows = SkewedRows(spec.rows)
    run = fit_recorded(spec, world_size, module, rows, packing=packing, budget=budget)
    return replace(run, num_microbatches=module.num_microbatches)


def budget_rank(rank: int, spec: RunSpec, budget: int, layouts: tuple[str, ...]) -> BudgetResult:
    """Per layout in ``layouts`` (``"padded"``/``"packed"``): a fixed-size fit and a fit with the
    token ``budget``; then the error of a budget below the shortest row (every rank raises)."""
    world_size = int(os.environ["WORLD_SIZE"])
    fixed, budgeted = {}, {}
    for layout in layouts:
        packing = layout == "packed"
        fixed[layout] = _fit(spec, world_size, packing, None)
        budgeted[layout] = _fit(spec, world_size, packing, budget)
    try:
        _fit(replace(spec, steps=1), world_size, packing=True, budget=5)
        error = ""
    except Exception as err:  # noqa: BLE001 - the message is the result
        error = f"{type(err).__name__}: {err}"
    return BudgetResult(fixed=fixed, budget=budgeted, error=error)
