"""Rank function of the stall test: the world group exists before the Trainer (created by
``run_on_ranks`` with its own, long timeout); rank 1 stalls in ``on_train_batch_start``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from _strategy_runs import TinyGPTModule, TokenRows
from helpers.trainer import cpu_trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.strategy import ReliabilityConfig

STRATEGY_TIMEOUT_S = 5.0
STALL_S = 25.0


@dataclass(frozen=True)
class StallResult:
    """This rank's error (``""``: none) and its seconds from its step's start to the error."""

    error: str
    seconds: float


class _Stalling(TinyGPTModule):
    def __init__(self) -> None:
        super().__init__()
        self.started = 0.0

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.started = time.perf_counter()
        if self.global_rank == 1:
            time.sleep(STALL_S)  # rank 0 waits in the step's first collective meanwhile


def stall_rank(rank: int) -> StallResult:
    module = _Stalling()
    strategy = MCoreRLStrategy(
        reliability=ReliabilityConfig(timeout=timedelta(seconds=STRATEGY_TIMEOUT_S))
    )
    trainer = cpu_trainer(strategy=strategy, max_steps=1)
    try:
        trainer.fit(module, DataLoader(TokenRows(4), batch_size=2))
    except Exception as err:  # noqa: BLE001 - the timeout is the point
        return StallResult(f"{type(err).__name__}: {err}", time.perf_counter() - module.started)
    return StallResult("", time.perf_counter() - module.started)
