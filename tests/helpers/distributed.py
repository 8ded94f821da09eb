"""Helpers of the multi-rank tests (``lightning_mcore_rl.testing.run_on_ranks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RunSpec:
    """One tiny-GPT training run: the megatron layout and the loop's sizes.

    The defaults are the single source of every run's unset options. Module-level and frozen:
    ``run_on_ranks`` pickles it to the ranks.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    bf16: bool = False
    num_layers: int = 2
    mbs: int = 2
    steps: int = 3
    rows: int = 32
    global_batch: int = 4
    clip: float | None = None

    @property
    def precision(self) -> str:
        """The Lightning ``Trainer(precision=...)`` of ``bf16``."""
        return "bf16-mixed" if self.bf16 else "32-true"

    def local_batch(self, world_size: int) -> int:
        """Rows per data-parallel rank and step (CP ranks hold the same rows)."""
        return self.global_batch // (world_size // (self.tp * self.pp * self.cp))
