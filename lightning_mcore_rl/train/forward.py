"""The forward step Megatron's schedule calls per microbatch (docs/behaviour-reference.md §2.1–2.3).

``forward_with_post_processing_fn`` pulls a :class:`ProcessedMicrobatch`, runs
:func:`model_forward`, applies the sampling temperature in place and returns
``(output, post_processor(...))``; Megatron applies the callable to the last stage's output.
With ``use_fused_linear_logprobs`` the last stage outputs its final hidden states instead of
logits and the post-processor gets a :class:`~lightning_mcore_rl.train.fused.FusedLMHead` (the
output weight and the temperature) to finish the LM head itself (:mod:`.fused`).
"""

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
from lightning_mcore_rl.train.extension import StepExtension, entered
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
    """Reject what the fused linear logprobs path cannot serve, identically on every rank.

    Called before megatron's schedule (and by the step entries before their first collective),
    so no rank is left waiting in a collective for one that raised.

    Args:
        chunks: This rank's model chunks.
        post_processing_fn: The pass's post-processor (``None``: not built yet).
        sampling_params: The step's sampling parameters.
        enabled: ``use_fused_linear_logprobs`` of the pass.

    Raises:
        ValueError: A loss / logprobs post-processor built with the other setting; with
            ``enabled``: top-k/top-p filtering, a top-k or teacher-payload post-processor,
            multi-token prediction.
        TypeError: With ``enabled``, a chunk that is not a megatron ``GPTModel``.
    """
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
    """Match a CP-local padding mask ``[B, S/CP]`` to the model's sequence-parallel layout.

    A first-stage ``GPTModel`` scatters the mask to the sequence-parallel region itself; any
    other chunk receives hidden states already split over TP, so the mask is scattered here.
    When the model CP-slices its own inputs the mask arrives full-width and is CP-sliced first.

    Args:
        model: The model chunk (possibly wrapped).
        padding_mask: ``[B, S/CP]`` (``[B, S]`` if the model slices CP itself) or ``None``.
        model_slices_context_parallel_inputs: Whether the model CP-slices its own inputs.
        groups: This rank's groups (their CP rank/size slice the mask); read only with
            ``model_slices_context_parallel_inputs`` (``None``: megatron's initialised state).

    Returns:
        The mask in the layout the model's layers see (``[B, S/CP/TP]`` under SP), or ``None``.
    """
    if padding_mask is None:
        return None
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.utils import get_model_config

    if model_slices_context_parallel_inputs:
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
    """One forward pass of a Megatron GPT chunk.

    Args:
        model: The model chunk.
        data_dict: The microbatch (multimodal inputs are not supported, see Raises).
        input_ids_cp_sharded: ``[B, S]`` or this CP rank's packed ``[1, T/CP]`` ids.
        position_ids: Position ids in the same layout.
        attention_mask: ``[1, 1, S, S]`` causal mask, ``None`` when packed.
        packed_seq_params: Megatron ``PackedSeqParams`` (passed only when not ``None``).
        defer_fp32_logits: Keep the logits in the model dtype (else cast to fp32; a
            ``Float16Module`` gets ``fp32_output=False``, as with fused linear logprobs).
        mtp_loss_mask: Passed as ``loss_mask`` (multi-token prediction: the forward step passes
            its weights ``token_mask * sample_mask / N_t``, `extensions/multi_token_prediction.py`).
        padding_mask: MoE-routing padding mask (see :func:`_prepare_padding_mask_for_model`).
        straggler_timer: Called once; the forward runs inside the returned context.
        use_fused_linear_logprobs: On the last stage, return the final hidden states (after the
            final norm) instead of logits: the output layer is bypassed for this forward
            (:func:`~lightning_mcore_rl.train.fused.lm_head_returns_hidden`).
            Otherwise a last stage computes its logits batch-first
            (:func:`~lightning_mcore_rl.train.fused.lm_head_batch_first`: the same logits
            without ``GPTModel``'s ``[B, S, V_l]`` copy) where it applies.
        labels_cp_sharded: Target labels: the model then returns per-token losses
            (direct prepacked SFT).
        loss_mask_cp_sharded: Loss mask passed with ``labels_cp_sharded``.
        media_token_validity_mask: Not supported (multimodal).
        model_slices_context_parallel_inputs: Whether the model CP-slices its own inputs.
        groups: This rank's groups (see :func:`_prepare_padding_mask_for_model`).

    Returns:
        Logits ``[B, S/CP, V_l]`` / ``[1, T/CP, V_l]`` on the last stage (fused: its final
        hidden states ``[B, S/CP, H]`` / ``[1, T/CP, H]`` in the model dtype), hidden states
        elsewhere, per-token losses when labels are given.

    Raises:
        ValueError: Labels together with fused linear logprobs.
        TypeError: Fused linear logprobs on a last stage that is not a megatron ``GPTModel``.
        NotImplementedError: Multimodal inputs (no VLM here).
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
    """Divide ``logits`` by the sampling temperature in place (same tensor, same ``data_ptr``).

    Args:
        logits: ``[..., V_l]`` model output.
        sampling_params: ``None`` or ``temperature == 1.0`` leaves ``logits`` unchanged.

    Returns:
        ``logits`` itself.
    """
    if sampling_params is not None and sampling_params.temperature != 1.0:
        logits.div_(sampling_params.temperature)  # in place: no second [B, S, V_l] copy
    return logits


@contextlib.contextmanager
def _capture_lm_head_input(
    model: torch.nn.Module, enabled: bool, tp_group: Any
) -> Iterator[dict[str, Tensor]]:
    """Record the input of the model's ``output_layer`` (pre-LM-head states ``[S/CP, B, H]``).

    Under sequence parallelism that input is this TP rank's sequence slice ``[S/CP/TP, B, H]``
    (the output layer all-gathers it itself), so it is all-gathered over TP along the sequence
    here, in megatron's rank order.
    """
    captured: dict[str, Tensor] = {}
    output_layer = getattr(_unwrap(model), "output_layer", None)
    if not enabled or output_layer is None:
        yield captured
        return

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        hidden = args[0].detach()
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
    enable_opd_full_capture: bool = False,
    use_fused_linear_logprobs: bool = False,
    model_slices_context_parallel_inputs: bool = False,
    *,
    extensions: Sequence[StepExtension] = (),
    training: bool = False,
    groups: ParallelGroups | None = None,
    num_microbatches: int | None = None,
) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, dict[str, Any]]]]:
    """Megatron's ``forward_step_func``: forward one processed microbatch, bind its post-processor.

    Args:
        data_iterator: Yields :class:`ProcessedMicrobatch`.
        model: The model chunk.
        post_processing_fn: One of the four post-processors (:data:`PostProcessingFunction`).
        defer_fp32_logits: Keep logits in the model dtype.
        global_valid_seqs: Valid sequences of the global batch (loss post-processor).
        global_valid_toks: Valid tokens of the global batch (loss post-processor).
        sampling_params: Temperature (applied here, in place, on the last stage; fused: handed
            to the post-processor, which divides ``hidden x W^T`` by it) and top-k/p.
        straggler_timer: See :func:`model_forward`.
        enable_opd_full_capture: Capture pre-LM-head hidden states for the teacher payload.
        use_fused_linear_logprobs: See :func:`model_forward`; the loss / logprobs post-processor
            then gets ``lm_head=FusedLMHead(...)`` on the last stage.
        model_slices_context_parallel_inputs: Whether the model CP-slices its own inputs.
        extensions: each one's `forward_kwargs`, its `forward_scope` around the model forward,
            its `microbatch_data` after it and its `wrap_loss` around the bound post-processor.
        training: a forward-backward pass (the extensions' scopes see it).
        groups: This rank's groups, handed to the post-processor (and the CP/TP helpers);
            ``None``: read from megatron's initialised state (the seed API's callers).
        num_microbatches: ``M`` of the pass, handed to a :class:`LossPostProcessor` (its
            loss scale); ``None``: the one it was built with.

    Returns:
        ``(output_tensor, fn)``; Megatron calls ``fn(output_tensor) -> (loss, metrics)``.

    Raises:
        TypeError: Unknown post-processor type.
        ValueError: Options the fused path cannot serve (:func:`check_fused_linear_logprobs`;
            megatron_forward_backward checks them before the schedule already).
        ValueError: what an extension's scope refuses (e.g. the draft's `check_draft`).
    """
    groups = resolve_groups(groups)  # the seed API's callers pass none
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
