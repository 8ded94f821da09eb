"""One forward(-backward) pass over a global batch through Megatron's real schedule
(docs/behaviour-reference.md §2.4); `run_schedule` is the package's one schedule runner."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import ParallelGroups, resolve_groups
from lightning_mcore_rl.train.extension import StepExtension, entered, seed_flag_extensions
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
    """Fine-grained activation offloading off for a forward-only pass of `model` (a chunk or
    the list), restored after, also on error; `forward_only=False` changes nothing."""
    # inference-only phases (logprobs, top-k) must not consume megatron's offload warm-up
    if not forward_only:
        yield
        return
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    # every config looked up first: a failing lookup mutates nothing (and the body does not run)
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
    draft_model: Any = None,
    enable_hidden_capture: bool | None = False,
    enable_opd_full_capture: bool = False,
    use_fused_linear_logprobs: bool = False,
    use_router_replay: bool = False,
    router_replay_train: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    *,
    extensions: Sequence[StepExtension] = (),
    groups: ParallelGroups | None = None,
) -> list[dict[str, Any]]:
    """Megatron's forward-backward schedule over `num_microbatches` microbatches of
    `data_iterator` with `post_processing_fn`: per-microbatch metric dicts on the last pipeline
    stage, `[]` elsewhere; gradients land in the DDP `main_grad` buffers.

    Args:
        seq_length: full model input width (`S`, or `T` packed); sizes the PP messages.
        mbs: micro-batch size (1 packed).
        draft_model, enable_hidden_capture, use_router_replay, router_replay_train: seed flags.
        extensions: the step's extensions (`pass_scope` around the schedule, forward hooks).
        groups: this rank's groups; `None`: megatron's initialised state (the seed API's callers).

    Raises:
        ValueError, TypeError: what the fused path cannot serve, on every rank, before the
            schedule (`check_fused_linear_logprobs`).
    """
    # `data_iterator` is a list of iterators with VPP; the seed flags become the extensions they
    # turn on (`seed_flag_extensions`)
    # the model config must carry calculate_per_token_loss=True and finalize_model_grads_func
    # (LossPostProcessor.scale_loss says why)
    groups = resolve_groups(groups)  # the seed API's callers pass none
    # the seed's flags become extensions once, so their pass scopes run around the schedule too
    extensions = seed_flag_extensions(
        extensions, draft_model, enable_hidden_capture, use_router_replay, router_replay_train
    )
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
    """The package's one schedule runner -> the loss functions' metric dicts, one per
    microbatch, on the last pipeline stage."""
    # megatron's `get_forward_backward_func()` (no pipelining, 1F1B or interleaved, from the
    # parallel state) over `chunks` with one iterator per chunk
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model: ModelChunks = list(chunks) if len(chunks) > 1 else chunks[0]
    # activation offloading is suspended for forward-only passes
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
