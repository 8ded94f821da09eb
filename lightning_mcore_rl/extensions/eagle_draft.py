"""Online EAGLE draft training inside the policy's step (`DraftExtension`)."""

# The capture of the layers the draft reads, its forward (`student_logits [B, S, V]` for
# `losses.DraftLossWrapper`) and its gradient finalisation; the draft is a megatron-DDP module
# outside the policy's chunks.

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.extensions.noop import NoExtension
from lightning_mcore_rl.losses import MetricNormalizer
from lightning_mcore_rl.parallel import ParallelGroups, unwrap_model

if TYPE_CHECKING:
    from lightning_mcore_rl.train.context import StepContext
    from lightning_mcore_rl.train.model_inputs import GlobalBatch, ProcessedMicrobatch
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction
    from lightning_mcore_rl.train.statistics import StepOutput


def aux_layers(draft_model: torch.nn.Module) -> tuple[int, ...]:
    """The policy decoder layers (global 0-based indices, ascending) a possibly wrapped draft
    reads (its ``aux_layers``)."""
    return tuple(int(i) for i in cast(Any, unwrap_model(draft_model)).aux_layers)


def check_draft(model: torch.nn.Module, draft_model: Any, groups: ParallelGroups) -> None:
    """Refuse what the draft path cannot serve, before `model`'s forward.

    Raises:
        ValueError: CP > 1; a last stage without a draft; an aux layer the last stage lacks.
    """
    # raised identically on the ranks of a stage; `draft_model` is `None` off the last stage
    if groups.cp_size > 1:
        raise ValueError(
            "draft-model training needs context_parallel_size=1 (the draft attends over whole "
            f"sequences), got CP={groups.cp_size}"
        )
    inner = unwrap_model(model)
    # not the last stage: nothing is captured here
    if not getattr(inner, "post_process", True):
        return
    if draft_model is None:
        raise ValueError(
            "`enable_hidden_capture=True` on the last pipeline stage needs the `draft_model` "
            "(build it there: MCoreRLModule.build_draft_model)"
        )
    # the draft reads layers of the last stage only
    held = {int(layer.layer_number) - 1 for layer in inner.decoder.layers}  # type: ignore[union-attr]
    aux = aux_layers(draft_model)
    missing = sorted(set(aux) - held)
    if missing:
        raise ValueError(
            f"the draft reads the policy's decoder layers {list(aux)}, but the last pipeline "
            f"stage holds layers {sorted(held)} only (missing {missing}); choose `aux_layers` "
            "among the last stage's layers"
        )


@contextlib.contextmanager
def capture_layer_outputs(
    model: torch.nn.Module, layers: Sequence[int], groups: ParallelGroups
) -> Iterator[dict[int, Tensor]]:
    """Record, detached, the outputs `{layer index: [S, B, H]}` of the policy's decoder `layers`
    (global 0-based indices held by this chunk) during the block."""
    captured: dict[int, Tensor] = {}
    inner = unwrap_model(model)
    sequence_parallel = bool(getattr(getattr(inner, "config", None), "sequence_parallel", False))
    handles = []

    def hook(index: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            # detached: nothing the draft does reaches the policy's graph
            hidden = (output[0] if isinstance(output, tuple) else output).detach()
            # under SP a layer's output is this TP rank's sequence slice: all-gather it over TP
            if sequence_parallel and groups.tp_size > 1:
                parts = [torch.empty_like(hidden) for _ in range(groups.tp_size)]
                dist.all_gather(parts, hidden.contiguous(), group=groups.tp_group)
                hidden = torch.cat(parts, dim=0)  # [S/TP, B, H] x TP -> [S, B, H]
            captured[index] = hidden

        return record

    # no layers (no draft): no hooks, and no assumption that the chunk is a GPT with a decoder
    for layer in inner.decoder.layers if layers else ():  # type: ignore[union-attr]
        index = int(layer.layer_number) - 1
        if index in layers:
            handles.append(layer.register_forward_hook(hook(index)))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def next_token_ids(input_ids: Tensor, cu_seqlens_padded: Tensor | None) -> Tensor:
    """`y_{t+1}` at position `t` of `input_ids [B, S]` (or the packed row `[1, T]` with its
    `cu_seqlens_padded [B+1]`), 0 at each row's (span's) last position."""
    shifted = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    if cu_seqlens_padded is not None:
        # 0 at each span's end: the shift never crosses a sequence boundary
        ends = cu_seqlens_padded[1:].long() - 1
        shifted[0, ends[ends >= 0]] = 0
    return shifted


def unpack_rows(packed: Tensor, cu_seqlens_padded: Tensor, width: int) -> Tensor:
    """The packed row `[1, T, X]` back in the padded layout `[B, S, X]` (`S = width`; each
    span's first `min(span, S)` positions, zeros after), keeping autograd."""
    rows = []
    bounds = [int(b) for b in cu_seqlens_padded]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        span = packed[0, start : min(end, start + width)]  # [s_i, X]
        rows.append(torch.nn.functional.pad(span, (0, 0, 0, width - span.shape[0])))
    return torch.stack(rows)


def draft_logits(
    draft_model: torch.nn.Module,
    captured: dict[int, Tensor],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    packed_seq_params: Any,
    cu_seqlens_padded: Tensor | None,
    width: int,
) -> Tensor:
    """The draft run on `captured`: `[B, S, V]` logits in the padded layout, token `t + 2` at
    position `t`, with gradient to the draft only.

    Args:
        input_ids: the model ids `[B, S_pad]` or the full packed row `[1, T]`.
        cu_seqlens_padded: `[B+1]` span boundaries (`None` padded).
        width: `S`, the microbatch's data width.
    """
    hidden = torch.cat([captured[i] for i in aux_layers(draft_model)], dim=-1)  # [S, B, k H]
    logits = draft_model(
        hidden, next_token_ids(input_ids, cu_seqlens_padded), attention_mask, packed_seq_params
    )
    if cu_seqlens_padded is not None:  # packed runs the draft on the row: packed = padded
        return unpack_rows(logits, cu_seqlens_padded, width)
    # padded: the model ran on `S_pad >= S` positions
    return logits[:, :width]


def draft_prepare_fn(prepare_fn: Callable[..., Any], cu_seqlens_padded: Tensor | None) -> Any:
    """The draft term's `prepare(logits, data, loss_fn, tp_rank, tp_group, cp_group) ->
    (loss_input, data)`: the policy logits `[B, S, V_l]` in the padded layout, then `prepare_fn`."""
    # `student_logits` is padded-layout, so the policy logits must be too; `prepare_fn` is
    # `prepare_loss_input` with the post-processor's bindings

    def prepare(logits: Tensor, data: Any, loss_fn: Any, *groups: Any) -> Any:
        width = int(data["input_ids"].shape[1])
        if cu_seqlens_padded is not None:
            logits = unpack_rows(logits, cu_seqlens_padded, width)  # [1, T, V_l] -> [B, S, V_l]
        # prepare_fn's DRAFT branch: the detached teacher rolled left by one
        return prepare_fn(logits[:, :width], data, loss_fn, *groups)

    return prepare


def finish_draft_gradients(
    draft_model: torch.nn.Module, global_valid_toks: Tensor | None = None
) -> None:
    """After the schedule: the DP gradient all-reduce of the draft, then (`global_valid_toks`
    given) the one division of its gradients by `N_t`."""
    # `None`: the microbatches normalised already
    draft_model.finish_grad_sync()  # type: ignore[operator]
    if global_valid_toks is None:
        return
    # defer_draft_normalization: the microbatches back-propagated raw sums
    scale = 1.0 / float(max(float(global_valid_toks), 1.0))
    with torch.no_grad():
        for param in draft_model.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None:
                grad.mul_(scale)


DRAFT_METRIC_NORMALIZATIONS = {
    "draft_loss": MetricNormalizer.TOKENS,
    "draft_top1_agreement": MetricNormalizer.TOKENS,
    "draft_expected_acceptance": MetricNormalizer.TOKENS,
}
"""The declared reductions of the draft's metrics (:class:`~lightning_mcore_rl.losses.DraftLossWrapper`:
contributions to the token mean over the policy loss's count, whose scored positions they share)."""


def normalise_deferred_draft_metrics(out: StepOutput, global_valid_toks: Tensor) -> StepOutput:
    """`out` with the raw-summed draft metrics divided once by `global_valid_toks`."""
    # what each microbatch would have divided by without `defer_draft_normalization`
    count = max(float(global_valid_toks), 1.0)
    metrics = dict(out.metrics)
    for key in DRAFT_METRIC_NORMALIZATIONS:
        if key in metrics:
            metrics[key] = metrics[key] / count
    return dataclasses.replace(out, metrics=metrics)


class DraftExtension(NoExtension):
    """The EAGLE draft trained in every training pass of the `loss_fn` path.

    Args:
        draft_model: the megatron-DDP-wrapped draft on the last pipeline stage, `None` elsewhere.
    """

    # the draft has its own gradient buffer; its optimizer step is the strategy's

    def __init__(self, draft_model: Any) -> None:
        self.draft_model = draft_model

    def normalizations(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> dict[str, MetricNormalizer]:
        """`draft_loss`, `draft_top1_agreement`, `draft_expected_acceptance` (training)."""
        return dict(DRAFT_METRIC_NORMALIZATIONS) if training else {}

    @contextlib.contextmanager
    def statistics_scope(
        self,
        chunks: Sequence[torch.nn.Module],
        global_batch: GlobalBatch,
        post: PostProcessingFunction,
        context: StepContext,
        training: bool,
    ) -> Iterator[Tensor | None]:
        """Zero the draft's gradient buffer before a training pass, reduce it after; yields the
        deferred `N_t` (`None`: nothing deferred) for `finish`."""
        if not training:
            yield None
            return
        # with `defer_draft_normalization` the microbatches sum raw and the division waits for
        # the global count
        deferred = bool(getattr(post, "defer_draft_normalization", False))
        count = global_batch.global_valid_toks if deferred else None
        if self.draft_model is not None:
            self.draft_model.zero_grad_buffer()
        yield count
        if self.draft_model is not None:
            finish_draft_gradients(self.draft_model, count)

    @contextlib.contextmanager
    def forward_scope(
        self,
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        training: bool,
    ) -> Iterator[dict[int, Tensor] | None]:
        """On a training forward of the last stage, capture the layers the draft reads.

        Raises:
            ValueError: see `check_draft`.
        """
        if not training:
            yield None
            return
        # before the forward, so no rank enters a collective the others skip
        check_draft(model, self.draft_model, groups)
        if not getattr(unwrap_model(model), "post_process", True):
            yield None
            return
        with capture_layer_outputs(model, aux_layers(self.draft_model), groups) as captured:
            yield captured

    def microbatch_data(
        self, model: torch.nn.Module, microbatch: ProcessedMicrobatch, state: Any
    ) -> dict[str, Tensor]:
        """`student_logits [B, S, V]`: the draft run on the captured layer outputs."""
        if state is None:
            return {}
        mb = microbatch
        student = draft_logits(
            self.draft_model, state, mb.input_ids, mb.attention_mask, mb.packed_seq_params,
            mb.cu_seqlens_padded if mb.packed_seq_params is not None else None,
            mb.original_seq_length,
        )  # fmt: skip
        return {"student_logits": student}

    def finish(self, out: StepOutput, state: Any, context: StepContext) -> StepOutput:
        """With `defer_draft_normalization` the draft metrics divided once by `N_t`."""
        return out if state is None else normalise_deferred_draft_metrics(out, state)


__all__ = [
    "DRAFT_METRIC_NORMALIZATIONS",
    "DraftExtension",
    "aux_layers",
    "capture_layer_outputs",
    "check_draft",
    "draft_logits",
    "draft_prepare_fn",
    "finish_draft_gradients",
    "next_token_ids",
    "normalise_deferred_draft_metrics",
    "unpack_rows",
]
