"""Batches, THD sequence packing, microbatching and global valid counts: a global batch becomes
this DP rank's `BatchedDataDict` (`shard_by_batch_size`), then fixed-size or token-budget
microbatches, each optionally packed into one THD row; `compute_global_valid_counts` gives the
loss normalisers. Shape notation: see `lightning_mcore_rl`."""

from lightning_mcore_rl.data.batched_data_dict import (
    BatchedDataDict,
    balanced_equal_count_partition,
)
from lightning_mcore_rl.data.microbatching import (
    GlobalValidCounts,
    MicrobatchPlan,
    TokenBudgetMicrobatches,
    compute_global_valid_counts,
    make_token_budget_microbatches,
    microbatch_cost,
    plan_token_budget_microbatches,
)
from lightning_mcore_rl.data.packing import (
    PackedSequences,
    cp_local_indices,
    get_pack_sequence_parameters,
    minimum_pad_individual,
    pack_sequences,
    packed_position_ids,
    padded_span_lengths,
    restore_packed_from_cp_shards,
    round_up,
    unpack_sequences,
)

__all__ = [
    "BatchedDataDict",
    "GlobalValidCounts",
    "MicrobatchPlan",
    "PackedSequences",
    "TokenBudgetMicrobatches",
    "balanced_equal_count_partition",
    "compute_global_valid_counts",
    "cp_local_indices",
    "get_pack_sequence_parameters",
    "make_token_budget_microbatches",
    "microbatch_cost",
    "minimum_pad_individual",
    "pack_sequences",
    "packed_position_ids",
    "padded_span_lengths",
    "plan_token_budget_microbatches",
    "restore_packed_from_cp_shards",
    "round_up",
    "unpack_sequences",
]
