"""Batches, THD sequence packing, microbatching and global valid counts.

A global batch becomes this data-parallel rank's :class:`BatchedDataDict` (``shard_by_batch_size``),
then exact microbatches: fixed size (``make_microbatch_iterator``) or token-budget
(:func:`make_token_budget_microbatches`), each optionally packed into one THD row
(:func:`pack_sequences` with the padding knobs of :func:`get_pack_sequence_parameters`).
:func:`compute_global_valid_counts` gives the loss normalisers over the DP group, and
:class:`PackedDotProductAttention` runs packed attention without Transformer Engine.
Shape notation: see :mod:`lightning_mcore_rl`.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from lightning_mcore_rl.data.packed_attention import (
        PackedDotProductAttention,
        get_packed_local_layer_spec,
    )

# packed_attention subclasses megatron-core's attention: imported on first use, so that importing
# the package (and `lmrl --help`) does not import megatron-core, seconds of start-up
_LAZY = {"PackedDotProductAttention", "get_packed_local_layer_spec"}


def __getattr__(name: str) -> Any:
    """The megatron-dependent names of :mod:`.packed_attention`, imported on first access."""
    if name in _LAZY:
        from lightning_mcore_rl.data import packed_attention

        return getattr(packed_attention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BatchedDataDict",
    "GlobalValidCounts",
    "MicrobatchPlan",
    "PackedDotProductAttention",
    "PackedSequences",
    "TokenBudgetMicrobatches",
    "balanced_equal_count_partition",
    "compute_global_valid_counts",
    "cp_local_indices",
    "get_pack_sequence_parameters",
    "get_packed_local_layer_spec",
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
