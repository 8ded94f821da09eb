"""The one trainer-free entry that runs a global batch: plan (split) -> megatron's schedule
(per microbatch forward -> post-process -> loss -> backward) -> statistics."""

# `run_global_batch` (training or validation -> `StepOutput`) and `run_forward_only` (logprobs,
# top-k logits, teacher payloads -> per-sample outputs) share the splitter and `run_schedule`.
# Everything a pass reads besides the batch and the chunks comes in one frozen `StepContext`;
# nothing here calls back into the module or reads megatron's `parallel_state`.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.data.packed_checks import check_packed_core_attention
from lightning_mcore_rl.losses import MetricNormalizer
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.train.context import Microbatching, StepContext
from lightning_mcore_rl.train.extension import StepExtension, entered, resolve_extensions
from lightning_mcore_rl.train.forward import check_fused_linear_logprobs
from lightning_mcore_rl.train.logits_dtype import defers_fp32_logits
from lightning_mcore_rl.train.loss_post_processor import LossPostProcessor
from lightning_mcore_rl.train.model_inputs import (
    GlobalBatch,
    layout_padding,
    process_global_batch,
)
from lightning_mcore_rl.train.post_processors import PostProcessingFunction
from lightning_mcore_rl.train.schedule import megatron_forward_backward, run_schedule
from lightning_mcore_rl.train.statistics import StepOutput, batch_counts, reduce_step_statistics
from lightning_mcore_rl.train.validation import (
    BatchSpec,
    BatchSummary,
    NonFinite,
    batch_summary,
    model_position_limit,
    model_vocab_size,
    validate_batch,
)

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[Tensor, Callable[..., Any]]]
"""Megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``."""

InputCheck = Callable[[NonFinite | None, BaseException | None, BatchSummary | None], bool]
"""``check(first_nonfinite, validation_error, summary) -> skip``: the caller's agreement over
ranks (the strategy's non-finite policy and batch agreement: one collective; re-raises the
error, raises when the ranks of a replica hold different batches, True skips the step);
``summary`` is ``None`` when the batch failed validation."""


def split_global_batch(
    batch: Mapping[str, Any],
    groups: ParallelGroups,
    microbatching: Microbatching,
    *,
    routing: bool = False,
    mtp: bool = False,
) -> GlobalBatch:
    """This DP rank's share of a global batch -> processed microbatches with the global valid
    counts."""
    # CP shards per rank, padded as the layout needs; `routing` / `mtp`: also build the MoE
    # routers' padding mask and replay ids / the MTP `mtp_loss_mask`
    data = batch if isinstance(batch, BatchedDataDict) else BatchedDataDict(batch)
    padding = layout_padding(
        sequence_packing=microbatching.sequence_packing,
        tp_size=groups.tp_size,
        cp_size=groups.cp_size,
        sequence_parallel=microbatching.sequence_parallel,
    )
    return process_global_batch(
        data,
        groups.dp_group,
        microbatching.micro_batch_size,
        sequence_packing=microbatching.sequence_packing,
        equal_shapes=microbatching.equal_shapes,
        max_tokens_per_microbatch=microbatching.max_tokens_per_microbatch,
        cp_rank=groups.cp_rank,
        cp_size=groups.cp_size,
        routing=routing,
        mtp=mtp,
        **padding,
    )


def split_lm_batch(batch: Mapping[str, Any], microbatching: Microbatching) -> list[BatchedDataDict]:
    """Fixed-size microbatches of an LM batch (`{"tokens", "labels"}`), same splitter."""
    if microbatching.max_tokens_per_microbatch is not None:
        raise ValueError(
            f"`max_tokens_per_microbatch={microbatching.max_tokens_per_microbatch}` needs the "
            "`MCoreRLModule(loss_fn=...)` path (batches with `input_lengths`); the "
            "`forward_step` path splits into fixed `micro_batch_size` microbatches."
        )
    data = batch if isinstance(batch, BatchedDataDict) else BatchedDataDict(batch)
    size = data.size
    if size % microbatching.micro_batch_size != 0:
        raise ValueError(
            f"This rank's batch has {size} samples, not divisible by micro_batch_size="
            f"{microbatching.micro_batch_size}; use a DataLoader batch_size that is a multiple "
            "of it."
        )
    return list(data.make_microbatch_iterator(microbatching.micro_batch_size))


def run_global_batch(
    chunks: Sequence[torch.nn.Module],
    batch: Mapping[str, Any],
    context: StepContext,
    *,
    loss: LossPostProcessor | None = None,
    normalizations: Mapping[str, MetricNormalizer] | None = None,
    forward_step_func: ForwardStepFunc | None = None,
    forward_only: bool = False,
    required_keys: Sequence[str] = (),
    required_by: str | None = None,
    input_check: InputCheck | None = None,
) -> StepOutput:
    """Forward(-backward) of one global batch; gradients land in the DDP buffers, finalised.

    Args:
        chunks: this rank's (wrapped) model chunks, one per virtual pipeline stage.
        batch: this DP rank's share of the global batch `[B, ...]`.
        loss: the `loss_fn` path's post-processor (the forward step binds the pass's `M`).
        normalizations: the loss's `metric_normalizations` (`loss_fn` path).
        forward_step_func: the LM path: megatron's `forward_step_func` over dict microbatches.
        forward_only: no backward (validation).
        required_keys: batch keys the loss reads (`loss_input_keys`), checked up front.
        required_by: the loss class the missing keys are named with.
        input_check: see `InputCheck`; `None`: errors raise at once, non-finite inputs unchecked.

    Returns:
        The `StepOutput`, identical on every rank (`loss = nan` when `input_check` skipped it).

    Raises:
        ValueError, TypeError: a malformed batch, or what `use_fused_linear_logprobs` cannot
            serve, before any collective of the step.
    """
    # the context's sampling_params apply to the last stage's logits exactly once (temperature
    # in place, top-k/top-p by the post-processors), on the loss_fn path only; there the
    # context's extensions (MoE, MTP, the EAGLE draft) join the pass at the core's hook points
    if (loss is None) == (forward_step_func is None):
        raise TypeError("pass exactly one of `loss` and `forward_step_func`")
    fused = context.use_fused_linear_logprobs
    if fused and forward_step_func is not None:
        raise ValueError(
            "`use_fused_linear_logprobs=True` needs the `MCoreRLModule(loss_fn=...)` path; the "
            "`forward_step` path computes megatron's own loss from logits"
        )
    sampling = context.sampling_params if loss is not None else None
    check_fused_linear_logprobs(chunks, loss, sampling, fused)
    microbatching, groups = context.microbatching, context.groups
    spec = BatchSpec(
        lm=forward_step_func is not None,
        vocab_size=model_vocab_size(chunks),
        required=tuple(required_keys),
        required_by=required_by,
        needs_lengths=microbatching.sequence_packing
        or microbatching.max_tokens_per_microbatch is not None,
        max_positions=model_position_limit(chunks),
    )
    skip, extensions = _checked_inputs_skip(batch, spec, input_check, chunks, context)
    if skip:
        return StepOutput(loss=torch.tensor(float("nan")))
    counts = batch_counts(batch)
    states: list[Any] = []  # what each extension's statistics scope yielded
    if forward_step_func is not None:
        microbatches = split_lm_batch(batch, microbatching)
        first = cast(Tensor, next(iter(microbatches[0].values())))  # [b, S]
        outputs = run_schedule(
            forward_step_func,
            chunks,
            [iter(microbatches) for _ in chunks],
            num_microbatches=len(microbatches),
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )
        source = "forward_step"
    else:
        assert loss is not None  # exactly one of the two, checked above
        _check_per_token_loss(chunks)
        training = not forward_only
        for ext in extensions:
            normalizations = {**(normalizations or {}), **ext.normalizations(chunks, training)}
        global_batch = split_global_batch(
            batch, groups, microbatching, **_split_options(extensions, training),
        )  # fmt: skip
        scopes = [
            ext.statistics_scope(chunks, global_batch, loss, context, training)
            for ext in extensions
        ]
        with entered(scopes) as states:
            outputs = _megatron_pass(chunks, global_batch, loss, context, forward_only, extensions)
        source = type(loss.loss_fn).__name__
    out = reduce_step_statistics(
        outputs, counts, groups, normalizations=normalizations, source=source,
        device=context.device,
    )  # fmt: skip
    for ext, state in zip(extensions, states, strict=False):  # none on the LM path
        out = ext.finish(out, state, context)
    return out


def run_forward_only(
    chunks: Sequence[torch.nn.Module],
    batch: Mapping[str, Any],
    context: StepContext,
    post_processor: PostProcessingFunction,
    *,
    input_check: InputCheck | None = None,
) -> dict[str, Tensor]:
    """A forward-only pass with `post_processor` (dropout off, train mode restored after).

    Returns:
        Every per-sample output (`logprobs [B, S]`, `topk_logits`/`topk_indices [B, S, K]`,
        `teacher_full_payload [B, S, D]`) in the batch's sample order, on CPU, on every rank.

    Raises:
        ValueError, TypeError: a malformed batch, or what `use_fused_linear_logprobs` cannot
            serve (top-k logits, teacher payloads, top-k/top-p).
    """
    # every rank gets the outputs: they are broadcast from the last pipeline stage. The batch
    # check raises before any collective (with `input_check`: after its one agreement
    # collective), the fused-path check before any collective.
    check_fused_linear_logprobs(
        chunks, post_processor, context.sampling_params, context.use_fused_linear_logprobs
    )
    microbatching, groups = context.microbatching, context.groups
    spec = BatchSpec(
        vocab_size=model_vocab_size(chunks),
        needs_lengths=microbatching.sequence_packing
        or microbatching.max_tokens_per_microbatch is not None,
        max_positions=model_position_limit(chunks),
    )
    _, extensions = _checked_inputs_skip(batch, spec, input_check, chunks, context)
    with _eval_mode(chunks), torch.no_grad():
        global_batch = split_global_batch(
            batch, groups, microbatching, **_split_options(extensions, False)
        )
        outputs = _megatron_pass(chunks, global_batch, post_processor, context, True, extensions)
    result: dict[str, Tensor] | None = None
    if groups.is_pipeline_last_stage:
        keys = [k for k in outputs[0] if isinstance(outputs[0][k], Tensor) and outputs[0][k].dim()]
        result = {k: global_batch.restore_order([o[k] for o in outputs]).cpu() for k in keys}
    if groups.pp_size > 1:
        holder = [result]
        dist.broadcast_object_list(holder, src=groups.pp_last_rank, group=groups.pp_group)
        result = holder[0]
    assert result is not None  # the last stage always fills it
    return result


def _split_options(extensions: Sequence[StepExtension], training: bool) -> dict[str, bool]:
    options: dict[str, bool] = {}
    for ext in extensions:
        options.update(ext.split_options(training))
    return options


def _checked_inputs_skip(
    batch: Mapping[str, Any],
    spec: BatchSpec,
    input_check: InputCheck | None,
    chunks: Sequence[torch.nn.Module],
    context: StepContext,
) -> tuple[bool, tuple[StepExtension, ...]]:
    """ONE validation pass of `batch` (host only) -> (skip, the pass's extensions)."""
    # each extension's `check_batch` runs too; the verdict and the batch's `batch_summary` go
    # through `input_check`; the LM path has no extensions
    extensions: tuple[StepExtension, ...] = ()
    try:
        finding = validate_batch(batch, spec)
        if not spec.lm:
            extensions = resolve_extensions(context, chunks)
        for ext in extensions:
            ext.check_batch(batch, chunks)
        # recorded experts only an MoE model replays: for any other they would be dropped
        if (
            not spec.lm
            and "routed_experts" in batch
            and not any(type(e).__name__ == "MoEExtension" for e in extensions)
        ):
            raise ValueError(
                "The batch carries `routed_experts` [B, S, L, K] but the model has no MoE "
                "layers (`num_moe_experts` unset) to replay them; drop the key"
            )
    except (ValueError, TypeError) as err:
        if input_check is None:
            raise
        input_check(None, err, None)  # agrees with the other ranks, then re-raises ``err``
        raise
    if input_check is None:
        return False, extensions
    return input_check(finding, None, batch_summary(batch, spec)), extensions


def _megatron_pass(
    chunks: Sequence[torch.nn.Module],
    global_batch: GlobalBatch,
    post: PostProcessingFunction,
    context: StepContext,
    forward_only: bool,
    extensions: Sequence[StepExtension],
) -> list[dict[str, Any]]:
    _check_temperature(post, context.sampling_params)
    if global_batch.microbatches[0].packed_seq_params is not None:
        for chunk in chunks:
            check_packed_core_attention(chunk)  # before megatron's schedule runs
    capture = post.captures_hidden_states
    iterators = [global_batch.iterator() for _ in chunks]
    return megatron_forward_backward(
        list(chunks) if len(chunks) > 1 else chunks[0],
        cast(Any, iterators if len(chunks) > 1 else iterators[0]),
        global_batch.num_microbatches,
        global_batch.seq_length,
        global_batch.micro_batch_size,
        post,
        forward_only=forward_only,
        global_valid_seqs=global_batch.global_valid_seqs,
        global_valid_toks=global_batch.global_valid_toks,
        defer_fp32_logits=defers_fp32_logits(
            context.defer_fp32_logits, post, context.sampling_params
        ),
        sampling_params=context.sampling_params,
        enable_opd_full_capture=capture,
        use_fused_linear_logprobs=context.use_fused_linear_logprobs,
        extensions=extensions,
        groups=context.groups,
    )


def _check_temperature(
    post: PostProcessingFunction, sampling_params: TrainingSamplingParams | None
) -> None:
    """Refuse a post-processor built with another temperature than the step's.

    Raises:
        ValueError: the two temperatures differ.
    """
    # the temperature is applied once, upstream: a post-processor's own would silently be ignored
    own = post.sampling_params
    step = 1.0 if sampling_params is None else sampling_params.temperature
    if own is not None and own.temperature != step:
        raise ValueError(
            f"{type(post).__name__} was built with temperature={own.temperature} but the step "
            f"applies temperature={step} (the module's `sampling_params()`); the temperature is "
            "applied once to the logits before any post-processor, so set it in "
            "`sampling_params()` and build the post-processor with the same one."
        )


def _check_per_token_loss(chunks: Sequence[torch.nn.Module]) -> None:
    from megatron.core.utils import get_model_config

    for i, chunk in enumerate(chunks):
        if not get_model_config(chunk).calculate_per_token_loss:
            raise ValueError(
                f"Model chunk {i} needs `TransformerConfig.calculate_per_token_loss=True` for "
                "the loss_fn path (build it with `MCoreRLModule.transformer_config(...)`)."
            )


@contextlib.contextmanager
def _eval_mode(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every submodule in eval mode (dropout off) for the block; each one's previous
    ``training`` flag restored after, also on error."""
    modules = [m for chunk in chunks for m in chunk.modules()]
    previous = [m.training for m in modules]
    try:
        for chunk in chunks:
            chunk.eval()
        yield
    finally:
        for module, flag in zip(modules, previous, strict=True):
            module.training = flag


def lm_forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[Tensor, Any]:
    """Megatron ``forward_step_func`` for a plain LM loss on ``{"tokens", "labels"}`` ``[b, S]``
    microbatches (the microbatch loss is the mean per-token cross entropy)."""
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    per_token_loss = model(tokens, position_ids, None, labels=batch["labels"])  # [b, S]

    def loss_func(output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss = output.float().mean()
        # clone: the schedule divides the returned loss in place by num_microbatches.
        return loss, {"loss": loss.detach().clone()}

    return per_token_loss, loss_func
