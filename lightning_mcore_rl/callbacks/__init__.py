"""Lightning callbacks for megatron-core RL training."""

from lightning_mcore_rl.callbacks.metrics_history import MetricsHistory

__all__ = ["MetricsHistory"]
