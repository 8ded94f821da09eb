"""The bottom layer: this rank's process groups and the model-chunk unwrapping."""

from lightning_mcore_rl.parallel.chunks import unwrap_model
from lightning_mcore_rl.parallel.groups import ParallelGroups, megatron_groups, resolve_groups
from lightning_mcore_rl.parallel.shards import host_ints, shard_range

__all__ = [
    "ParallelGroups",
    "host_ints",
    "megatron_groups",
    "resolve_groups",
    "shard_range",
    "unwrap_model",
]
