"""The Megatron training step: forward, post-processing, schedule and statistics."""

# A global batch becomes processed microbatches (`process_global_batch`, global valid counts over
# DP once); `megatron_forward_backward` runs Megatron's schedule with
# `forward_with_post_processing_fn` as the forward step, which runs `model_forward`, applies the
# temperature in place and binds a post-processor (with the pass's groups and `M`):
# `LossPostProcessor` (training loss, scaled by `M / CP^2` to cancel Megatron's averaging, see
# `LossPostProcessor.scale_loss`), `LogprobsPostProcessor`, `TopkLogitsPostProcessor` or
# `TeacherFullPayloadPostProcessor` (forward-only). `aggregate_training_statistics` reduces the
# losses over DP.
# `run_global_batch` / `run_forward_only` (`.step`) are the one trainer-free entry the strategy
# calls for a whole global batch: split, schedule, statistics, with ONE frozen `StepContext`
# passed down explicitly.
# Shapes: `B` sequences, `S` width, `T` packed tokens, `V_l = V/TP`, `CP` context-parallel size;
# model output `[B, S/CP, V_l]` (padded) or `[1, T/CP, V_l]` (packed).

from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.train.context import Microbatching, StepContext
from lightning_mcore_rl.train.cp_layout import (
    CP_NEEDS_PACKING,
    should_reduce_loss_across_context_parallel,
    strip_context_parallel_local_loss_metric,
)
from lightning_mcore_rl.train.forward import (
    _prepare_padding_mask_for_model,
    apply_temperature_scaling,
    forward_with_post_processing_fn,
    model_forward,
)
from lightning_mcore_rl.train.loss_post_processor import LossPostProcessor
from lightning_mcore_rl.train.model_inputs import (
    GlobalBatch,
    ProcessedMicrobatch,
    causal_attention_mask,
    check_microbatching,
    process_global_batch,
    process_microbatch,
)
from lightning_mcore_rl.train.policy_config import PolicyConfig, load_policy_config
from lightning_mcore_rl.train.post_processors import (
    LogprobsPostProcessor,
    PostProcessingFunction,
    TeacherFullPayloadPostProcessor,
    TopkLogitsPostProcessor,
)
from lightning_mcore_rl.train.schedule import (
    megatron_forward_backward,
    run_schedule,
    suspend_activation_offload_for_forward_only,
)
from lightning_mcore_rl.train.statistics import (
    STEP_OUTPUT_KEY,
    StepOutput,
    aggregate_training_statistics,
    batch_counts,
    reduce_step_statistics,
)
from lightning_mcore_rl.train.step import (
    ForwardStepFunc,
    lm_forward_step,
    run_forward_only,
    run_global_batch,
    split_global_batch,
    split_lm_batch,
)

__all__ = [
    "CP_NEEDS_PACKING",
    "STEP_OUTPUT_KEY",
    "ForwardStepFunc",
    "Microbatching",
    "ParallelGroups",
    "StepContext",
    "StepOutput",
    "GlobalBatch",
    "LogprobsPostProcessor",
    "LossPostProcessor",
    "PolicyConfig",
    "PostProcessingFunction",
    "ProcessedMicrobatch",
    "TeacherFullPayloadPostProcessor",
    "TopkLogitsPostProcessor",
    "_prepare_padding_mask_for_model",
    "aggregate_training_statistics",
    "batch_counts",
    "check_microbatching",
    "lm_forward_step",
    "reduce_step_statistics",
    "run_forward_only",
    "run_global_batch",
    "run_schedule",
    "split_global_batch",
    "split_lm_batch",
    "apply_temperature_scaling",
    "causal_attention_mask",
    "forward_with_post_processing_fn",
    "load_policy_config",
    "megatron_forward_backward",
    "model_forward",
    "process_global_batch",
    "process_microbatch",
    "should_reduce_loss_across_context_parallel",
    "strip_context_parallel_local_loss_metric",
    "suspend_activation_offload_for_forward_only",
]
