"""One forward(-backward) pass over a global batch through Megatron's real schedule
(docs/behaviour-reference.md §2.4); :func:`run_schedule` is the package's one schedule runner."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import ParallelGroups, resolve_groups
from lightning_mcore_rl.train.extension import StepExtension, entered
from lightning_mcore_rl.train.forward import (
    check_fused_linear_logprobs,
    forward_with_post_processing_fn,
)
from lightning_mcore_rl.train.model_inputs import ProcessedMicrobatch
from lightning_mcore_rl.train.post_processors import PostProcessingFunction

ModelChunks = torch.nn.Module | list[torch.nn.Module]


@contextlib.contextmanager
def suspend_activation_offload_for_forward_only(
    model: ModelChunks, forward_only: bool
) -> Iterator[None]:
    """Disable fine-grained activation offloading for a forward-only pass, restore it after.

    Inference-only phases (logprobs, top-k) must not consume Megatron's offload warm-up. Every
    distinct chunk config is looked up first, so a failing lookup mutates nothing (and the body
    does not run); the previous values, and the global offload manager's state if it exists,
    are restored on exit, also on error. ``forward_only=False`` changes nothing.

    Args:
        model: A model chunk or the list of chunks.
        forward_only: Whether the pass is forward-only.

    Yields:
        Nothing; offloading is suspended inside the block.
    """
    if not forward_only:
        yield
        return
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    configs = {id(c): c for c in (get_model_config(chunk) for chunk in chunks)}  # atomic lookup
    previous = {key: cfg.fine_grained_activation_offloading for key, cfg in configs.items()}
    manager = _offload_manager()
    manager_was_on = bool(getattr(manager, "do_offload", False))
    try:
        for cfg in configs.values():
            cfg.fine_grained_activation_offloading = False
        if manager_was_on:
            manager.disable_offload()
        yield
    finally:
        for key, cfg in configs.items():
            cfg.fine_grained_activation_offloading = previous[key]
        if manager_was_on:
            manager.enable_offload()


def _offload_manager() -> Any:
    """Megatron's global activation-offload manager if one was created (never creates one)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    return PipelineOffloadManager.OFFLOAD_MGR


def megatron_forward_backward(
    model: ModelChunks,
    data_iterator: Iterator[ProcessedMicrobatch] | list[Iterator[ProcessedMicrobatch]],
    num_microbatches: int,
    seq_length: int,
    mbs: int,
    post_processing_fn: PostProcessingFunction,
    forward_only: bool = False,
    defer_fp32_logits: bool | None = False,
    global_valid_seqs: Tensor | None = None,
    global_valid_toks: Tensor | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    straggler_timer: Callable[[], Any] | None = None,
    enable_opd_full_capture: bool = False,
    use_fused_linear_logprobs: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    *,
    extensions: Sequence[StepExtension] = (),
    groups: ParallelGroups | None = None,
) -> list[dict[str, Any]]:
    """Run Megatron's forward-backward schedule (no pipelining, 1F1B or interleaved).

    Gradients land in the DDP ``main_grad`` buffers; the model config must carry
    ``calculate_per_token_loss=True`` and ``finalize_model_grads_func`` (see
    ``LossPostProcessor.scale_loss`` for why).

    Args:
        model: A model chunk or the list of VPP chunks.
        data_iterator: Iterator of :class:`ProcessedMicrobatch` (a list of them with VPP).
        num_microbatches: ``M``.
        seq_length: Full model input width (``S``, or ``T`` when packed); sizes PP messages.
        mbs: Micro-batch size (1 when packed).
        post_processing_fn: The post-processor.
        forward_only: Skip the backward pass (offloading suspended meanwhile).
        defer_fp32_logits: Keep logits in the model dtype.
        global_valid_seqs: Valid sequences of the global batch.
        global_valid_toks: Valid tokens of the global batch.
        sampling_params: Temperature / top-k / top-p.
        straggler_timer: Called once per forward.
        enable_opd_full_capture: Capture pre-LM-head states for the teacher payload.
        use_fused_linear_logprobs: See :func:`~lightning_mcore_rl.train.model_forward`; what
            it cannot serve raises here, on every rank, before the schedule
            (:func:`~lightning_mcore_rl.train.forward.check_fused_linear_logprobs`).
        model_slices_context_parallel_inputs: Whether the model CP-slices its own inputs.
        extensions: the step's extensions: each one's `pass_scope` around the schedule, its
            `forward_scope` around every microbatch's forward.
        groups: This rank's groups, passed to the forward step and every post-processor
            (with ``num_microbatches``, which a :class:`LossPostProcessor` scales by);
            ``None``: read from megatron's initialised state (the seed API's callers).

    Returns:
        Per-microbatch metric dicts on the last pipeline stage, ``[]`` elsewhere.
    """
    groups = resolve_groups(groups)  # the seed API's callers pass none
    forward_step = functools.partial(
        forward_with_post_processing_fn,
        post_processing_fn=post_processing_fn,
        defer_fp32_logits=defer_fp32_logits,
        global_valid_seqs=global_valid_seqs,
        global_valid_toks=global_valid_toks,
        sampling_params=sampling_params,
        straggler_timer=straggler_timer,
        enable_opd_full_capture=enable_opd_full_capture,
        use_fused_linear_logprobs=use_fused_linear_logprobs,
        model_slices_context_parallel_inputs=model_slices_context_parallel_inputs,
        extensions=extensions,
        training=not forward_only,
        groups=groups,
        num_microbatches=num_microbatches,
    )
    chunks = model if isinstance(model, list) else [model]
    check_fused_linear_logprobs(
        chunks, post_processing_fn, sampling_params, use_fused_linear_logprobs
    )
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    with entered([ext.pass_scope(chunks, not forward_only) for ext in extensions]):
        return run_schedule(
            forward_step,
            chunks,
            iterators,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )


def run_schedule(
    forward_step_func: Callable[..., Any],
    chunks: Sequence[torch.nn.Module],
    data_iterators: Sequence[Iterator[Any]],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """THE schedule runner: megatron's ``get_forward_backward_func()`` (no pipelining, 1F1B or
    interleaved, chosen from the parallel state) with activation offloading suspended for
    forward-only passes.

    Args:
        forward_step_func: megatron's ``forward_step_func(data_iterator, model)``.
        chunks: the model chunks (one per virtual pipeline stage).
        data_iterators: one iterator over the same microbatches per chunk.
        num_microbatches: ``M``.
        seq_length: model input width (``S``, or ``T`` packed); sizes the PP messages.
        micro_batch_size: samples per microbatch (1 packed).
        forward_only: skip the backward pass.

    Returns:
        The loss functions' metric dicts, one per microbatch, on the last pipeline stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model: ModelChunks = list(chunks) if len(chunks) > 1 else chunks[0]
    with suspend_activation_offload_for_forward_only(model, forward_only):
        return get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=list(data_iterators) if len(chunks) > 1 else data_iterators[0],
            model=model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length,
            forward_only=forward_only,
        )
