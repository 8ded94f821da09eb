"""Lightning callbacks for megatron-core RL training."""

from lightning_mcore_rl.callbacks.hf_export import HFExport
from lightning_mcore_rl.callbacks.metrics_history import MetricsHistory
from lightning_mcore_rl.callbacks.training_statistics import TIMING_METRICS, TrainingStatistics

__all__ = ["TIMING_METRICS", "HFExport", "MetricsHistory", "TrainingStatistics"]
