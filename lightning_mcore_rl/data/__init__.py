"""Batches, THD sequence packing, microbatching and global valid counts.

A global batch becomes this data-parallel rank's :class:`BatchedDataDict` (``shard_by_batch_size``),
then exact microbatches: fixed size (``make_microbatch_iterator``) or token-budget
(:func:`make_token_budget_microbatches`), each optionally packed into one THD row
(:func:`pack_sequences` with the padding knobs of :func:`get_pack_sequence_parameters`).
:func:`compute_global_valid_counts` gives the loss normalisers over the DP group.
Shape notation: see :mod:`lightning_mcore_rl`.
"""

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
