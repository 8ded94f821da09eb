"""Distributed tensor math: vocab-parallel logprobs/entropy/top-k and context-parallel layout.

Every function takes its process groups explicitly; nothing here reads Lightning or loss state.
"""

from lightning_mcore_rl.ops.context_parallel import (
    get_tokens_on_this_cp_rank,
    restore_from_cp_shards,
)

__all__ = ["get_tokens_on_this_cp_rank", "restore_from_cp_shards"]
