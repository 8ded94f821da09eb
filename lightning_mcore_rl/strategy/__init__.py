"""Lightning integration: `MCoreRLStrategy` and its precision, optimizer and checkpoint
plumbing, and `ResumableLoader` for exact mid-epoch resume. Megatron is imported lazily
(inside hooks), so importing this package needs no GPU."""

from lightning_mcore_rl.strategy.config import (
    CheckpointConfig,
    LogprobKernelConfig,
    MegatronDDPConfig,
    MicrobatchConfig,
    ParallelSizes,
    ReliabilityConfig,
)
from lightning_mcore_rl.strategy.optimizer import (
    MegatronOptimizerAdapter,
    MegatronOptimizerSpec,
    MegatronStepResult,
    check_trainer_flags,
)
from lightning_mcore_rl.strategy.precision import MCorePrecision
from lightning_mcore_rl.strategy.resumable import ResumableLoader, resumable_dataloader
from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy, register_strategy
from lightning_mcore_rl.strategy.teacher import load_dist_checkpoint

__all__ = [
    "CheckpointConfig",
    "LogprobKernelConfig",
    "MCorePrecision",
    "MCoreRLStrategy",
    "MegatronDDPConfig",
    "MegatronOptimizerAdapter",
    "MegatronOptimizerSpec",
    "MegatronStepResult",
    "MicrobatchConfig",
    "ParallelSizes",
    "ReliabilityConfig",
    "ResumableLoader",
    "check_trainer_flags",
    "load_dist_checkpoint",
    "register_strategy",
    "resumable_dataloader",
]
