"""The bottom layer: this rank's process groups and the model-chunk unwrapping."""

from lightning_mcore_rl.parallel.chunks import unwrap_model
from lightning_mcore_rl.parallel.groups import ParallelGroups, megatron_groups, resolve_groups

__all__ = ["ParallelGroups", "megatron_groups", "resolve_groups", "unwrap_model"]
