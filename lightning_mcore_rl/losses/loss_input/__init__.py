"""Loss-input preparation: from logits `[B, S/CP, V/TP]` (padded) or `[1, T/CP, V/TP]`
(packed) to what a loss consumes, by `loss_fn.input_type` (see `LossInputType`)."""

# docs/behaviour-reference.md §3.2-3.5. Process groups are passed in explicitly;
# `vocab_parallel_group=None` selects a plain single-process path (full-vocab logits).

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction, LossInputType
from lightning_mcore_rl.losses.loss_input._common import (
    OPD_FULL_PAYLOAD_FIELD,
    OPD_FULL_TEACHER_INDEX_FIELD,
    logprob_loss_input,
    mask_out_neg_inf_logprobs,
    next_token_entropy,
    next_token_logprobs,
)
from lightning_mcore_rl.losses.loss_input._draft import _distillation_loss_input, _draft_loss_input
from lightning_mcore_rl.losses.loss_input.opd_full import _prepare_opd_full_loss_input
from lightning_mcore_rl.losses.loss_input.packed import (
    _pack_input_ids,
    prepare_packed_loss_input,
    unpack_per_token,
)
from lightning_mcore_rl.ops import TrainingSamplingParams


def prepare_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    d2t: Tensor | None = None,
    chunk_size: int | None = None,
    cp_sharder: Any = None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> tuple[dict[str, Any], BatchedDataDict]:
    """`(loss_input, data)` of one unpacked microbatch from `[B, S/CP, V/TP]` logits
    (temperature applied; the model's next-token logprobs with `use_fused_linear_logprobs`).

    `data` gains `curr_logprobs_unfiltered` with top-k/top-p and a reference KL; `d2t` is the
    `[V_draft]` draft-to-target offsets; `teacher_output_layer_weight_by_index` holds `[V/TP, H_t]`
    LM-head shards per teacher (`OPD_FULL` hidden-state payloads).

    Raises:
        NotImplementedError: `cp_sharder` (NeMo Automodel's DTensor CP) is given.
        ValueError: unknown input type or missing inputs.
    """
    if cp_sharder is not None:
        raise NotImplementedError(
            "`cp_sharder` belongs to NeMo Automodel's DTensor path; this project shards context "
            "parallelism the Megatron way: pass `context_parallel_group` instead"
        )
    input_type = loss_fn.input_type
    # LOGIT: untouched (value heads, reward models)
    if input_type is LossInputType.LOGIT:
        return {"logits": logits}, data
    groups = (vocab_parallel_rank, vocab_parallel_group, context_parallel_group)
    # LOGPROB: next-token logprobs (+ the positive entropy when the loss has `entropy_coef > 0`)
    if input_type is LossInputType.LOGPROB:
        return logprob_loss_input(logits, data, loss_fn, *groups, sampling_params, chunk_size), data
    if input_type is LossInputType.DISTILLATION:
        return _distillation_loss_input(logits, data, loss_fn, *groups), data
    # DRAFT: the policy logits rolled left by one as the draft model's teacher, `[B, S, V]`
    if input_type is LossInputType.DRAFT:
        return _draft_loss_input(
            logits, data, vocab_parallel_group, context_parallel_group, d2t
        ), data
    if input_type is LossInputType.OPD_FULL:
        loss_input = _prepare_opd_full_loss_input(
            logits, data, loss_fn, vocab_parallel_rank=vocab_parallel_rank,
            vocab_parallel_group=vocab_parallel_group,
            context_parallel_group=context_parallel_group, sampling_params=sampling_params,
            chunk_size=chunk_size,
            teacher_output_layer_weight_by_index=teacher_output_layer_weight_by_index,
        )  # fmt: skip
        return loss_input, data
    raise ValueError(f"Unknown loss function input type {input_type!r}")


__all__ = [
    "OPD_FULL_PAYLOAD_FIELD",
    "OPD_FULL_TEACHER_INDEX_FIELD",
    "_pack_input_ids",
    "_prepare_opd_full_loss_input",
    "mask_out_neg_inf_logprobs",
    "next_token_entropy",
    "next_token_logprobs",
    "logprob_loss_input",
    "prepare_loss_input",
    "prepare_packed_loss_input",
    "unpack_per_token",
]
