"""The forward step megatron's schedule calls per microbatch (docs/behaviour-reference.md §2)."""

# `forward_with_post_processing_fn` -> `model_forward`, the temperature in place,
# `(output, bound post-processor)` (§2.1-2.3).

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.ops import TrainingSamplingParams, get_tokens_on_this_cp_rank
from lightning_mcore_rl.parallel import ParallelGroups, resolve_groups
from lightning_mcore_rl.parallel import unwrap_model as _unwrap
from lightning_mcore_rl.train.binding import Binding
from lightning_mcore_rl.train.extension import StepExtension, entered, seed_flag_extensions
from lightning_mcore_rl.train.fused import (
    FUSED_NEEDS_LOGITS,
    FusedLMHead,
    batch_first_applies,
    check_fused_chunks,
    lm_head_batch_first,
    lm_head_returns_hidden,
    output_weight,
    reject_filtering,
)
from lightning_mcore_rl.train.model_inputs import ProcessedMicrobatch
from lightning_mcore_rl.train.post_processors import PostProcessingFunction


def _is_last_stage(model: torch.nn.Module) -> bool:
    """Whether this chunk computes the LM head (Megatron's ``post_process``)."""
    return bool(getattr(_unwrap(model), "post_process", True))


def _in_float16_module(model: torch.nn.Module) -> bool:
    """Whether megatron's ``Float16Module`` is in the wrapper chain (it takes ``fp32_output``)."""
    from megatron.core.transformer.module import Float16Module

    while not isinstance(model, Float16Module):
        if not hasattr(model, "module"):
            return False
        model = cast(torch.nn.Module, model.module)  # DDP wraps a module
    return True


def check_fused_linear_logprobs(
    chunks: Sequence[torch.nn.Module],
    post_processing_fn: PostProcessingFunction | None,
    sampling_params: TrainingSamplingParams | None,
    enabled: bool,
) -> None:
    """Reject what the fused linear logprobs path (`enabled`) cannot serve.

    Raises:
        ValueError: a loss / logprobs post-processor built with the other setting; with
            `enabled`: top-k/top-p, a top-k or teacher-payload post-processor, MTP.
        TypeError: with `enabled`, a chunk that is not a megatron `GPTModel`.
    """
    # identical on every rank; `post_processing_fn` is `None` before it is built
    # called before megatron's schedule (and by the step entries before their first
    # collective): no rank is left waiting in a collective for one that raised
    if post_processing_fn is not None:
        name = type(post_processing_fn).__name__
        if enabled and post_processing_fn.needs_full_logits:
            raise ValueError(FUSED_NEEDS_LOGITS.format(what=name))
        own = post_processing_fn.use_fused_linear_logprobs
        if own != enabled:
            raise ValueError(
                f"{name} was built with use_fused_linear_logprobs={own} but the pass runs with "
                f"use_fused_linear_logprobs={enabled}; build it with the strategy's setting "
                "(the MCoreRLModule hooks do)"
            )
    if not enabled:
        return
    reject_filtering(sampling_params, "the step's sampling_params")
    check_fused_chunks(chunks)


def _prepare_padding_mask_for_model(
    model: torch.nn.Module,
    padding_mask: Tensor | None,
    model_slices_context_parallel_inputs: bool = False,
    groups: ParallelGroups | None = None,
) -> Tensor | None:
    """A CP-local padding mask `[B, S/CP]` (`[B, S]` when the model CP-slices its own inputs)
    in the layout the model's layers see (`[B, S/CP/TP]` under SP), or `None`."""
    if padding_mask is None:
        return None
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.utils import get_model_config

    if model_slices_context_parallel_inputs:  # the mask arrives full-width: CP-slice it first
        groups = resolve_groups(groups)  # the seed API's callers pass none
        if groups.cp_size > 1:
            padding_mask = get_tokens_on_this_cp_rank(
                padding_mask, groups.cp_rank, groups.cp_size, seq_dim=1
            )
    if not get_model_config(model).sequence_parallel:
        return padding_mask
    inner = _unwrap(model)
    if isinstance(inner, GPTModel) and inner.pre_process:
        return padding_mask  # GPTModel.forward scatters it (megatron-core gpt_model.py)
    # any other chunk receives hidden states already split over TP: scatter the mask here
    scattered = tensor_parallel.scatter_to_sequence_parallel_region(
        padding_mask.transpose(0, 1).contiguous()  # [S, B]: SP splits dim 0
    )
    return scattered.transpose(0, 1).contiguous()


def model_forward(
    model: torch.nn.Module,
    data_dict: BatchedDataDict,
    input_ids_cp_sharded: Tensor,
    position_ids: Tensor | None,
    attention_mask: Tensor | None,
    packed_seq_params: Any = None,
    defer_fp32_logits: bool | None = False,
    mtp_loss_mask: Tensor | None = None,
    padding_mask: Tensor | None = None,
    straggler_timer: Callable[[], Any] | None = None,
    use_fused_linear_logprobs: bool = False,
    labels_cp_sharded: Tensor | None = None,
    loss_mask_cp_sharded: Tensor | None = None,
    media_token_validity_mask: Tensor | None = None,
    model_slices_context_parallel_inputs: bool = False,
    groups: ParallelGroups | None = None,
) -> Tensor:
    """One forward pass of a megatron GPT chunk on `input_ids_cp_sharded` (`[B, S]` or this CP
    rank's packed `[1, T/CP]`).

    Args:
        attention_mask: `[1, 1, S, S]` causal mask, `None` when packed.
        defer_fp32_logits: keep the logits in the model dtype (else cast to fp32).
        mtp_loss_mask: passed as `loss_mask` (the MTP extension's weights).
        padding_mask: the MoE routers' padding mask (`_prepare_padding_mask_for_model`).
        straggler_timer: called once; the forward runs inside the returned context.
        use_fused_linear_logprobs: the last stage returns its final (post-norm) hidden states.
        labels_cp_sharded: target labels: the model returns per-token losses (prepacked SFT).

    Returns:
        Logits `[B, S/CP, V_l]` / `[1, T/CP, V_l]` on the last stage (fused: hidden states
        `[.., H]` in the model dtype), hidden states elsewhere, per-token losses with labels.

    Raises:
        ValueError: labels together with fused linear logprobs.
        TypeError: fused linear logprobs on a last stage that is not a megatron `GPTModel`.
        NotImplementedError: multimodal inputs.
    """
    if use_fused_linear_logprobs and labels_cp_sharded is not None:
        raise ValueError("Direct packed SFT labels do not support fused linear logprobs")
    if media_token_validity_mask is not None:
        raise NotImplementedError("multimodal inputs are not supported by this project")
    kwargs: dict[str, Any] = {}
    if packed_seq_params is not None:
        kwargs["packed_seq_params"] = packed_seq_params
    if mtp_loss_mask is not None:
        kwargs["loss_mask"] = mtp_loss_mask
    if padding_mask is not None:
        kwargs["padding_mask"] = _prepare_padding_mask_for_model(
            model, padding_mask, model_slices_context_parallel_inputs, groups
        )
    if labels_cp_sharded is not None:
        kwargs["labels"] = labels_cp_sharded
        if loss_mask_cp_sharded is not None:
            kwargs["loss_mask"] = loss_mask_cp_sharded
    fused = use_fused_linear_logprobs and _is_last_stage(model)
    if fused:
        check_fused_chunks([model])
    if (defer_fp32_logits or fused) and _in_float16_module(model):
        kwargs["fp32_output"] = False  # Float16Module would upcast the whole last-stage output
    timer = straggler_timer() if straggler_timer is not None else contextlib.nullcontext()
    bypass: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if fused:
        bypass = lm_head_returns_hidden(model)
    elif labels_cp_sharded is None and _is_last_stage(model) and batch_first_applies(model):
        bypass = lm_head_batch_first(model)  # no [B, S, V_l] copy of the logits
    with timer, bypass:
        output = model(input_ids_cp_sharded, position_ids, attention_mask, **kwargs)
    if isinstance(output, tuple):
        output = output[0]
    if not (defer_fp32_logits or fused) and labels_cp_sharded is None and _is_last_stage(model):
        output = output.float()
    return output


def apply_temperature_scaling(
    logits: Tensor, sampling_params: TrainingSamplingParams | None
) -> Tensor:
    """`logits [..., V_l]` divided by the sampling temperature in place, returned (`None` or
    temperature 1 leave them unchanged)."""
    if sampling_params is not None and sampling_params.temperature != 1.0:
        logits.div_(sampling_params.temperature)  # in place: no second [B, S, V_l] copy
    return logits


@contextlib.contextmanager
def _capture_lm_head_input(
    model: torch.nn.Module, enabled: bool, tp_group: Any
) -> Iterator[dict[str, Tensor]]:
    """Record the input of the model's `output_layer` (pre-LM-head states `[S/CP, B, H]`)."""
    captured: dict[str, Tensor] = {}
    output_layer = getattr(_unwrap(model), "output_layer", None)
    if not enabled or output_layer is None:
        yield captured
        return

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        hidden = args[0].detach()
        # under SP the input is this TP rank's sequence slice (the output layer all-gathers it
        # itself): all-gather it here too, in megatron's rank order
        if getattr(module, "sequence_parallel", False):  # False at TP=1 (megatron resets it)
            parts = [torch.empty_like(hidden) for _ in range(tp_group.size())]
            torch.distributed.all_gather(parts, hidden.contiguous(), group=tp_group)
            hidden = torch.cat(parts, dim=0)  # [S/CP/TP, B, H] x TP -> [S/CP, B, H]
        captured["hidden_states"] = hidden

    handle = output_layer.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def forward_with_post_processing_fn(
    data_iterator: Iterator[ProcessedMicrobatch],
    model: torch.nn.Module,
    post_processing_fn: PostProcessingFunction,
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
    training: bool = False,
    groups: ParallelGroups | None = None,
    num_microbatches: int | None = None,
) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict[str, Any]]]]:
    """Megatron's `forward_step_func`: forward one `ProcessedMicrobatch`, bind its
    post-processor -> `(output, fn)`; megatron calls `fn(output) -> (loss, metrics)`.

    Args:
        sampling_params: temperature (in place on the last stage; fused: on `hidden x W^T`), top-k/p.
        draft_model, enable_hidden_capture: the seed's EAGLE draft, trained in this pass.
        enable_opd_full_capture: capture pre-LM-head hidden states for the teacher payload.
        use_router_replay, router_replay_train: the seed's router replay, its backward armed.
        extensions: the step extensions (forward kwargs, scopes, microbatch data, loss wrap).
        training: a forward-backward pass (the extensions' scopes see it).
        groups: handed to the post-processor; `None`: megatron's initialised state.
        num_microbatches: `M` of the pass, for a `LossPostProcessor`'s loss scale.

    Raises:
        TypeError: an unknown post-processor type.
        ValueError: what the fused path cannot serve; what an extension's scope refuses.
    """
    groups = resolve_groups(groups)  # the seed API's callers pass none
    # the seed's draft and router-replay flags become `extensions` (the draft's / the MoE one)
    extensions = seed_flag_extensions(
        extensions, draft_model, enable_hidden_capture, use_router_replay, router_replay_train
    )
    if not callable(getattr(post_processing_fn, "bind", None)):
        raise TypeError(
            f"Unknown post-processing function type {type(post_processing_fn).__name__}; "
            "expected a LossPostProcessor, LogprobsPostProcessor, TopkLogitsPostProcessor, "
            "TeacherFullPayloadPostProcessor or another PostProcessingFunction (with `bind`)"
        )
    check_fused_linear_logprobs(
        [model], post_processing_fn, sampling_params, use_fused_linear_logprobs
    )
    mb = next(data_iterator)
    extra: dict[str, Any] = {}  # the extensions' model kwargs (MTP's loss weights)
    for ext in extensions:
        extra.update(ext.forward_kwargs(mb, global_valid_toks))
    with (
        entered([ext.forward_scope(model, mb, groups, training) for ext in extensions]) as states,
        _capture_lm_head_input(model, enable_opd_full_capture, groups.tp_group) as captured,
    ):
        output = model_forward(
            model, mb.data_dict, mb.input_ids_cp_sharded, mb.position_ids, mb.attention_mask,
            mb.packed_seq_params, defer_fp32_logits,
            padding_mask=mb.padding_mask, straggler_timer=straggler_timer,
            use_fused_linear_logprobs=use_fused_linear_logprobs,
            model_slices_context_parallel_inputs=model_slices_context_parallel_inputs,
            groups=groups, **extra,
        )  # fmt: skip
    data_dict = mb.data_dict
    added: dict[str, Tensor] = {}  # what the extensions add for the post-processor
    for ext, state in zip(extensions, states, strict=True):
        added.update(ext.microbatch_data(model, mb, state))
    if added:
        data_dict = BatchedDataDict({**data_dict, **added})
    head: FusedLMHead | None = None
    if _is_last_stage(model):  # earlier stages output hidden states, not logits
        if use_fused_linear_logprobs:  # the temperature goes into hidden x W^T / T, once
            head = FusedLMHead(output_weight(model), sampling_params)
        else:
            apply_temperature_scaling(output, sampling_params)
    fn = post_processing_fn.bind(
        Binding(
            data_dict, mb.input_ids, mb.packed_seq_params, mb.cu_seqlens_padded,
            mb.original_seq_length, groups, num_microbatches, global_valid_seqs,
            global_valid_toks, head, captured.get("hidden_states"),
        )
    )  # fmt: skip
    for ext in extensions:
        fn = ext.wrap_loss(fn, model, mb, groups, post_processing_fn.trains)
    return output, fn
