"""Distributed tensor math: vocab-parallel logprobs/entropy/top-k and context-parallel layout.
Shapes: `V_l = V/TP` the local vocab shard, `K` ids per token (the rest: `lightning_mcore_rl`)."""

# every function takes its process groups explicitly; nothing here reads Lightning or loss state
from lightning_mcore_rl.ops.context_parallel import (
    allgather_cp_sharded_tensor,
    get_tokens_on_this_cp_rank,
    restore_from_cp_shards,
)
from lightning_mcore_rl.ops.fused_linear import (
    FusedLinearLogprobsOutput,
    GradientPredictionWarning,
    LogprobGradient,
    from_hidden_to_logprobs,
    from_hidden_to_logprobs_packed_sequences,
    fused_linear_logprobs,
)
from lightning_mcore_rl.ops.logprobs import (
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    packed_local_targets,
)
from lightning_mcore_rl.ops.reverse_kl import ReverseKLOutput, vocab_parallel_reverse_kl
from lightning_mcore_rl.ops.sampling import (
    TrainingSamplingParams,
    apply_top_k_top_p,
    distributed_logprob_with_sampling,
)
from lightning_mcore_rl.ops.topk import (
    DistillationTopkLogprobs,
    distributed_vocab_topk,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
)
from lightning_mcore_rl.ops.vocab_parallel import (
    distributed_log_softmax,
    distributed_logprob,
    distributed_logprobs_at_indices,
    vocab_parallel_entropy,
    vocab_range_for_rank,
)

__all__ = [
    "DistillationTopkLogprobs",
    "FusedLinearLogprobsOutput",
    "GradientPredictionWarning",
    "LogprobGradient",
    "ReverseKLOutput",
    "TrainingSamplingParams",
    "allgather_cp_sharded_tensor",
    "apply_top_k_top_p",
    "distributed_log_softmax",
    "distributed_logprob",
    "distributed_logprob_with_sampling",
    "distributed_logprobs_at_indices",
    "distributed_vocab_topk",
    "from_hidden_to_logprobs",
    "from_hidden_to_logprobs_packed_sequences",
    "from_parallel_logits_to_logprobs",
    "from_parallel_logits_to_logprobs_packed_sequences",
    "fused_linear_logprobs",
    "gather_logits_at_global_indices",
    "get_distillation_topk_logprobs_from_logits",
    "get_tokens_on_this_cp_rank",
    "packed_local_targets",
    "restore_from_cp_shards",
    "vocab_parallel_entropy",
    "vocab_parallel_reverse_kl",
    "vocab_range_for_rank",
]
