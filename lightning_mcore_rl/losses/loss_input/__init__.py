"""Loss-input preparation: from (TP/CP-sharded) model logits to what a loss consumes.

Behaviour: docs/behaviour-reference.md §3.2–3.5.

``prepare_loss_input`` dispatches on ``loss_fn.input_type``:

* ``LOGIT``: ``{"logits": logits}`` untouched (value heads, reward models).
* ``LOGPROB``: ``{"next_token_logprobs": [B, S-1]}`` (+ ``entropy [B, S-1]``, the positive
  per-token entropy, when the loss has ``cfg.entropy_coef > 0``).
* ``DISTILLATION``: student/teacher top-k logprobs ``[B, S-1, K]`` and ``H_all [B, S-1]``.
* ``DRAFT``: policy logits rolled left by one as the draft model's teacher ``[B, S, V]``.
* ``OPD_FULL``: per-token full-vocabulary reverse KL to a teacher ``[B, S-1]``.

Shapes: ``B`` sequences, ``S`` padded width of the unpacked batch, ``T`` packed tokens, ``V``
vocab, ``V_l = V/TP`` this rank's vocab shard, ``CP`` context-parallel size. Logits arrive as
``[B, S/CP, V_l]`` (padded) or ``[1, T/CP, V_l]`` (packed). Process groups are passed in explicitly;
``vocab_parallel_group=None`` selects a plain single-process path (full-vocab logits).
"""

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
    """Prepare the loss input of one (unpacked) microbatch.

    Args:
        logits: ``[B, S/CP, V_l]`` model output (temperature already applied); for
            ``loss_fn.use_fused_linear_logprobs`` the model's next-token logprobs instead.
        data: The microbatch (``input_ids [B, S]``, masks, ...). Mutated when top-k/top-p is
            active and the loss has a reference KL (``curr_logprobs_unfiltered`` is added).
        loss_fn: The loss; its ``input_type`` selects the branch.
        vocab_parallel_rank: TP rank (``None``: the group's rank).
        vocab_parallel_group: TP group; ``None`` selects the plain full-vocab path.
        context_parallel_group: CP group (``None``: CP = 1).
        sampling_params: top-k/top-p for ``LOGPROB`` (temperature is applied by the caller).
        d2t: ``[V_draft]`` draft-to-target vocab offsets (``DRAFT`` only).
        chunk_size: sequence chunk of the logprob kernels (``policy.logprob_chunk_size``).
        cp_sharder: NeMo Automodel's DTensor CP sharder; not supported (Megatron CP only).
        teacher_output_layer_weight_by_index: per-teacher ``[V_l, H_t]`` LM-head shards
            (``OPD_FULL`` hidden-state payloads only).

    Returns:
        ``(loss_input, data)``.

    Raises:
        NotImplementedError: ``cp_sharder`` is given.
        ValueError: Unknown input type or missing inputs.
    """
    if cp_sharder is not None:
        raise NotImplementedError(
            "`cp_sharder` belongs to NeMo Automodel's DTensor path; this project shards context "
            "parallelism the Megatron way: pass `context_parallel_group` instead"
        )
    input_type = loss_fn.input_type
    if input_type is LossInputType.LOGIT:
        return {"logits": logits}, data
    groups = (vocab_parallel_rank, vocab_parallel_group, context_parallel_group)
    if input_type is LossInputType.LOGPROB:
        return logprob_loss_input(logits, data, loss_fn, *groups, sampling_params, chunk_size), data
    if input_type is LossInputType.DISTILLATION:
        return _distillation_loss_input(logits, data, loss_fn, *groups), data
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
