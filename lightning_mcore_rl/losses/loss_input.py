"""Loss-input preparation: from (TP/CP-sharded) model logits to what a loss consumes (spec §3.2–3.5).

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

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction, LossInputType
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    apply_top_k_top_p,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    get_distillation_topk_logprobs_from_logits,
    get_tokens_on_this_cp_rank,
    vocab_parallel_entropy,
    vocab_parallel_reverse_kl,
)

OPD_FULL_PAYLOAD_FIELD = "teacher_full_payload"
"""Data column holding the teacher's full-vocabulary payload ``[B, S, D]``."""
OPD_FULL_TEACHER_INDEX_FIELD = "teacher_index"
"""Data column ``[B]``: which teacher (key of ``teacher_output_layer_weight_by_index``) a row uses."""


def _group_size(group: Any) -> int:
    return 1 if group is None else int(group.size())


def _group_rank(group: Any) -> int:
    return 0 if group is None else int(group.rank())


def _filters(sampling_params: TrainingSamplingParams | None) -> bool:
    return sampling_params is not None and sampling_params.filters


def _vocab_range(logits: Tensor, vocab_parallel_rank: int | None, group: Any) -> tuple[int, int]:
    rank = _group_rank(group) if vocab_parallel_rank is None else vocab_parallel_rank
    local_vocab = logits.shape[-1]
    return rank * local_vocab, (rank + 1) * local_vocab


def _as_ints(values: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


def _reference_kl_penalty(loss_fn: LossFunction) -> float:
    """The loss's reference-KL beta (ClippedPG attribute or an OPD-full config), else 0."""
    if hasattr(loss_fn, "reference_policy_kl_penalty"):
        return float(loss_fn.reference_policy_kl_penalty)
    if loss_fn.input_type is LossInputType.OPD_FULL:
        return float(loss_fn.cfg.reference_policy_kl_penalty)
    return 0.0


def _needs_entropy(loss_fn: LossFunction) -> bool:
    return float(getattr(getattr(loss_fn, "cfg", None), "entropy_coef", 0.0)) > 0


def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor, name: str) -> Tensor:
    """Replace ``-inf`` logprobs (tokens removed by top-k/top-p) with 0, warning for valid ones.

    The positions still count in the loss normalisers (spec §10 trap 9).

    Args:
        logprobs: ``[B, S-1]`` logprobs.
        mask: ``[B, S-1]`` validity mask (``token_mask[:, 1:] * sample_mask``).
        name: Name used in the warning.

    Returns:
        ``[B, S-1]`` with every ``-inf`` replaced by 0 (masked positions too: ``0 * -inf`` would
        poison the masked mean with NaN).
    """
    neg_inf = torch.isneginf(logprobs)
    valid = int((neg_inf & (mask > 0)).sum())
    if valid:
        warnings.warn(
            f"{valid} valid `{name}` entries are -inf (the token was removed by top-k/top-p "
            "filtering); they are set to 0.",
            stacklevel=2,
        )
    return logprobs.masked_fill(neg_inf, 0.0)


def _plain_next_token_logprobs(
    input_ids: Tensor, logits: Tensor, sampling_params: TrainingSamplingParams | None
) -> Tensor:
    """Single-process path: ``log_softmax(filter(logits[:, :-1]))`` gathered at ``ids[:, 1:]``."""
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"without a vocab-parallel group `logits` must be the full [B, S, V] for `input_ids` "
            f"{tuple(input_ids.shape)}, got {tuple(logits.shape)}"
        )
    z = logits[:, :-1].float()
    if _filters(sampling_params):
        assert sampling_params is not None
        flat, _ = apply_top_k_top_p(z.reshape(-1, z.shape[-1]), sampling_params.top_k,
                                    sampling_params.top_p)  # fmt: skip
        z = flat.view_as(z)
    return z.log_softmax(-1).gather(-1, input_ids[:, 1:, None].long()).squeeze(-1)


def next_token_logprobs(
    input_ids: Tensor,
    logits: Tensor,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
) -> Tensor:
    """Next-token logprobs of dense sequences (spec §5.8).

    Args:
        input_ids: ``[B, S]`` unshifted ids.
        logits: ``[B, S/CP, V_l]`` (temperature already applied).
        vocab_parallel_rank: TP rank (``None``: the group's rank).
        vocab_parallel_group: TP group; ``None`` for the plain full-vocab path.
        context_parallel_group: CP group (``None``: CP = 1).
        sampling_params: top-k/top-p filtering when active.
        chunk_size: sequence chunk for the chunked kernel (used only without filtering).

    Returns:
        ``[B, S-1]`` fp32 logprobs.
    """
    if vocab_parallel_group is None:
        if _group_size(context_parallel_group) > 1:
            raise ValueError("context parallelism needs `vocab_parallel_group` (the TP group)")
        return _plain_next_token_logprobs(input_ids, logits, sampling_params)
    use_chunking = chunk_size is not None and not _filters(sampling_params)
    if not use_chunking:
        logits = logits.float()  # the chunked kernel upcasts one chunk at a time instead
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
    logprobs = from_parallel_logits_to_logprobs(
        logits, input_ids, start, end, vocab_parallel_group, inference_only=False,
        cp_group=context_parallel_group, chunk_size=chunk_size if use_chunking else None,
        sampling_params=sampling_params,
    )  # fmt: skip
    return logprobs[:, : input_ids.shape[1] - 1]


def next_token_entropy(
    logits: Tensor, seq_len: int, vocab_parallel_group: Any, context_parallel_group: Any,
    chunk_size: int | None,
) -> Tensor:  # fmt: skip
    """Positive entropy ``-sum_v p log p`` of the distribution scoring token ``t+1``.

    Args:
        logits: ``[B, S/CP, V_l]`` dense logits.
        seq_len: ``S``.
        vocab_parallel_group: TP group (``None``: full-vocab logits).
        context_parallel_group: CP group.
        chunk_size: sequence chunk of the entropy kernel.

    Returns:
        ``[B, S-1]`` fp32 entropy, differentiable.
    """
    if vocab_parallel_group is None:
        logp = logits[:, : seq_len - 1].float().log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)
    entropy = vocab_parallel_entropy(logits, vocab_parallel_group, chunk_size)
    if _group_size(context_parallel_group) > 1:
        entropy = allgather_cp_sharded_tensor(entropy, context_parallel_group, seq_dim=1)
    return entropy[:, : seq_len - 1]


def _finish_logprob_input(
    logprobs: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    sampling_params: TrainingSamplingParams | None,
    unfiltered: Any,
) -> dict[str, Any]:
    """Top-k/top-p ``-inf`` masking and the unfiltered logprobs for the reference KL (spec §3.2)."""
    if _filters(sampling_params):
        mask = (data["token_mask"] * data["sample_mask"].unsqueeze(-1))[:, 1:]
        logprobs = mask_out_neg_inf_logprobs(logprobs, mask, "curr_logprobs")
        if _reference_kl_penalty(loss_fn) != 0:
            data["curr_logprobs_unfiltered"] = unfiltered()
    return {"next_token_logprobs": logprobs}


def _draft_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    d2t: Tensor | None,
) -> dict[str, Any]:
    """Teacher = the policy's detached logits rolled left by one, in the draft vocabulary."""
    if _group_size(context_parallel_group) > 1:
        raise NotImplementedError(
            "DRAFT loss input with context parallelism needs the draft model's CP layout "
            "(EAGLE draft models are not part of this project); use CP=1"
        )
    teacher = logits.detach()
    tp = _group_size(vocab_parallel_group)
    if tp > 1:  # the soft cross-entropy runs over the full vocab: gather the shards
        parts = [torch.empty_like(teacher) for _ in range(tp)]
        torch.distributed.all_gather(parts, teacher.contiguous(), group=vocab_parallel_group)
        teacher = torch.cat(parts, dim=-1)
    teacher = teacher.roll(-1, dims=1)
    if d2t is not None:
        reverse_mapping = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        teacher = teacher[..., reverse_mapping]
    if "student_logits" not in data:
        raise ValueError("DRAFT loss input needs the draft model's `student_logits` in the data")
    return {
        "teacher_logits": teacher,
        "student_logits": data["student_logits"],
        "token_mask": data["token_mask"].roll(-1, dims=1),
    }


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
    if input_type is LossInputType.LOGPROB:
        input_ids = data["input_ids"]
        seq_len = input_ids.shape[1]
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            logprobs = logits.float()[:, : seq_len - 1]
        else:
            logprobs = next_token_logprobs(
                input_ids, logits, vocab_parallel_rank, vocab_parallel_group,
                context_parallel_group, sampling_params, chunk_size,
            )  # fmt: skip
        loss_input = _finish_logprob_input(
            logprobs, data, loss_fn, sampling_params,
            lambda: next_token_logprobs(
                input_ids, logits, vocab_parallel_rank, vocab_parallel_group,
                context_parallel_group, None, None,
            ),
        )  # fmt: skip
        if _needs_entropy(loss_fn):
            loss_input["entropy"] = next_token_entropy(
                logits, seq_len, vocab_parallel_group, context_parallel_group, chunk_size
            )
        return loss_input, data
    if input_type is LossInputType.DISTILLATION:
        if vocab_parallel_group is None:
            raise ValueError("DISTILLATION loss input needs `vocab_parallel_group` (the TP group)")
        cfg = loss_fn.cfg
        start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
        out = get_distillation_topk_logprobs_from_logits(
            logits, data["teacher_topk_logits"], data["teacher_topk_indices"],
            cfg.zero_outside_topk, cfg.zero_outside_topk and cfg.kl_type != "forward",
            start, end, vocab_parallel_group, context_parallel_group,
        )  # fmt: skip
        loss_input = {
            "student_topk_logprobs": out.student_topk_logprobs,
            "teacher_topk_logprobs": out.teacher_topk_logprobs,
        }
        if out.H_all is not None:
            loss_input["H_all"] = out.H_all
        return loss_input, data
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


def _pack_input_ids(
    input_ids: Tensor,
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_q_padded: Tensor | Sequence[int],
    cp_rank: int = 0,
    cp_size: int = 1,
    roll_shift: int = 0,
) -> Tensor:
    """Pack ``[B, S]`` ids into this CP rank's THD row, optionally rolled inside each span.

    Args:
        input_ids: ``[B, S]`` right-padded ids.
        cu_seqlens_q: ``[B+1]`` sequence boundaries (may be the padded ones, spec trap 11).
        cu_seqlens_q_padded: ``[B+1]`` padded span boundaries.
        cp_rank: CP rank.
        cp_size: ``CP``; each span must be a multiple of ``2*CP``.
        roll_shift: roll of each padded span (``-1``: next-token targets); never crosses spans.

    Returns:
        ``[1, T/CP]`` with ``T = cu_seqlens_q_padded[-1]``; span ``i`` holds its first
        ``min(len_i, S)`` tokens (bin-fill padding may make ``len_i > S``), then zeros.
    """
    cu_q, cu_qp = _as_ints(cu_seqlens_q), _as_ints(cu_seqlens_q_padded)
    width = input_ids.shape[1]
    out = input_ids.new_zeros(1, cu_qp[-1] // cp_size)
    for i in range(len(cu_qp) - 1):
        padded = cu_qp[i + 1] - cu_qp[i]
        if padded == 0:
            continue
        n = min(cu_q[i + 1] - cu_q[i], width, padded)
        span = input_ids.new_zeros(padded)
        span[:n] = input_ids[i, :n]
        if roll_shift:
            span = span.roll(roll_shift)
        shard = get_tokens_on_this_cp_rank(span, cp_rank, cp_size, seq_dim=0)
        out[0, cu_qp[i] // cp_size : cu_qp[i + 1] // cp_size] = shard
    return out


def unpack_per_token(
    values: Tensor, cu_seqlens_padded: Sequence[int], width: int, context_parallel_group: Any
) -> Tensor:
    """Per-token packed values ``[T/CP]`` -> ``[B, S-1]`` (each span's last position dropped).

    Args:
        values: ``[T/CP]`` this CP rank's packed values (per-span zigzag shards).
        cu_seqlens_padded: ``[B+1]`` span boundaries.
        width: ``S``.
        context_parallel_group: CP group (per-span all-gather when CP > 1, spec trap 3).

    Returns:
        ``[B, S-1]``, zeros past each span's ``min(len - 1, S - 1)`` entries.
    """
    cp_size = _group_size(context_parallel_group)
    rows = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True):
        n = max(0, min(end - start - 1, width - 1))
        span = values[start // cp_size : end // cp_size]
        if n and cp_size > 1:
            span = allgather_cp_sharded_tensor(span, context_parallel_group, seq_dim=0)
        rows.append(F.pad(span[:n], (0, width - 1 - n)))
    return torch.stack(rows)


def prepare_packed_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_q_padded: Tensor | Sequence[int],
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
) -> tuple[dict[str, Any], BatchedDataDict]:
    """Loss input of a whole packed microbatch in one pass (``LOGPROB`` only, spec §3.4).

    Args:
        logits: ``[1, T/CP, V_l]`` packed logits (temperature applied).
        data: The unpacked microbatch (``input_ids [B, S]``, masks).
        loss_fn: A ``LOGPROB`` loss.
        cu_seqlens_q: ``[B+1]`` sequence boundaries (host ints or a CPU tensor).
        cu_seqlens_q_padded: ``[B+1]`` padded span boundaries.
        vocab_parallel_rank: TP rank (``None``: the group's rank).
        vocab_parallel_group: TP group (required).
        context_parallel_group: CP group (``None``: CP = 1).
        sampling_params: top-k/top-p filtering.
        chunk_size: sequence chunk (used only without filtering).

    Returns:
        ``(loss_input, data)`` with ``next_token_logprobs [B, S-1]`` (+ ``entropy``).

    Raises:
        ValueError: Non-``LOGPROB`` loss or no TP group.
    """
    if loss_fn.input_type is not LossInputType.LOGPROB:
        raise ValueError(
            f"prepare_packed_loss_input supports LossInputType.LOGPROB only, got "
            f"{loss_fn.input_type!r}; use SequencePackingLossWrapper for other losses"
        )
    if vocab_parallel_group is None:
        raise ValueError("prepare_packed_loss_input needs `vocab_parallel_group` (the TP group)")
    cp_rank, cp_size = _group_rank(context_parallel_group), _group_size(context_parallel_group)
    input_ids = data["input_ids"]
    width = input_ids.shape[1]
    cu_qp = _as_ints(cu_seqlens_q_padded)
    targets = _pack_input_ids(input_ids, cu_seqlens_q, cu_qp, cp_rank, cp_size, roll_shift=-1)
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)

    def logprobs_with(params: TrainingSamplingParams | None, chunk: int | None) -> Tensor:
        use_chunking = chunk is not None and not _filters(params)
        return from_parallel_logits_to_logprobs_packed_sequences(
            logits if use_chunking else logits.float(), targets, cu_qp, width, start, end,
            vocab_parallel_group, inference_only=False, cp_group=context_parallel_group,
            chunk_size=chunk if use_chunking else None, sampling_params=params,
            target_is_pre_rolled=True,
        )  # fmt: skip

    loss_input = _finish_logprob_input(
        logprobs_with(sampling_params, chunk_size), data, loss_fn, sampling_params,
        lambda: logprobs_with(None, None),
    )  # fmt: skip
    if _needs_entropy(loss_fn):
        entropy = vocab_parallel_entropy(logits, vocab_parallel_group, chunk_size)[0]  # [T/CP]
        loss_input["entropy"] = unpack_per_token(entropy, cu_qp, width, context_parallel_group)
    return loss_input, data


def _teacher_logits_shard(
    payload: Tensor,
    data: BatchedDataDict,
    local_shape: torch.Size,
    start: int,
    end: int,
    cp_rank: int,
    cp_size: int,
    tp_size: int,
    weights: dict[int, Tensor] | None,
) -> Tensor:
    """This rank's detached teacher logits ``[B, S/CP, V_l]`` from a ``[B, S, D]`` payload."""
    batch, local_seq, local_vocab = local_shape
    padded = F.pad(payload, (0, 0, 0, local_seq * cp_size - payload.shape[1]))
    window = get_tokens_on_this_cp_rank(padded, cp_rank, cp_size, seq_dim=1)  # [B, S/CP, D]
    if weights is None:
        if payload.shape[-1] != local_vocab * tp_size:
            raise ValueError(
                f"a logits payload must be [B, S, V] with V = V_l * TP = {local_vocab} * {tp_size}, "
                f"got shape {tuple(payload.shape)}"
            )
        return window[..., start:end].detach()
    if OPD_FULL_TEACHER_INDEX_FIELD not in data:
        raise ValueError(
            f"a hidden-state payload needs `{OPD_FULL_TEACHER_INDEX_FIELD}` [B] in the data"
        )
    index = _as_ints(data[OPD_FULL_TEACHER_INDEX_FIELD])
    rows = []
    for b in range(batch):
        if index[b] not in weights:
            raise ValueError(
                f"row {b} uses teacher {index[b]} but only {sorted(weights)} LM heads were given"
            )
        weight = weights[index[b]]  # [V_l, H_t]
        rows.append(window[b].to(weight.dtype) @ weight.t())
    return torch.stack(rows).detach()


def _prepare_opd_full_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    *,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
    teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
) -> dict[str, Any]:
    """Full-vocabulary on-policy-distillation loss input from student logits + teacher payload.

    The teacher payload ``data["teacher_full_payload"] [B, S, D]`` is either the teacher's
    logits (``D = V``; used when ``teacher_output_layer_weight_by_index`` is ``None``) or its
    pre-LM-head hidden states (``D = H_t``, projected with the row's teacher LM-head shard chosen
    by ``data["teacher_index"] [B]``).

    Args:
        logits: Student logits ``[B, S/CP, V_l]``.
        data: Microbatch with the payload column.
        loss_fn: The ``OPD_FULL`` loss.
        vocab_parallel_rank: TP rank (``None``: the group's rank).
        vocab_parallel_group: TP group (required).
        context_parallel_group: CP group.
        sampling_params: Unused by the divergence (exact expectation); kept for the seed API.
        chunk_size: Sequence chunk of the reverse-KL kernel.
        teacher_output_layer_weight_by_index: Per-teacher ``[V_l, H_t]`` LM-head shards.

    Returns:
        ``opd_full_divergence [B, S-1]`` (differentiable), ``opd_full_entropy`` (``sum p log p``)
        and ``opd_full_cross_entropy`` ``[B, S-1]`` (metrics), plus unfiltered
        ``next_token_logprobs`` when the loss has a reference KL.

    Raises:
        NotImplementedError: No vocab-parallel group.
        ValueError: The payload column is missing or malformed.
    """
    if vocab_parallel_group is None:
        raise NotImplementedError("OPD_FULL loss input needs `vocab_parallel_group` (TP group)")
    if OPD_FULL_PAYLOAD_FIELD not in data:
        raise ValueError(
            f"OPD_FULL loss input needs the teacher payload column `{OPD_FULL_PAYLOAD_FIELD}` "
            f"[B, S, D]; keys: {sorted(data)}"
        )
    cp_rank, cp_size = _group_rank(context_parallel_group), _group_size(context_parallel_group)
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
    seq_len = data["input_ids"].shape[1]
    teacher = _teacher_logits_shard(
        data[OPD_FULL_PAYLOAD_FIELD], data, logits.shape, start, end, cp_rank, cp_size,
        _group_size(vocab_parallel_group), teacher_output_layer_weight_by_index,
    ).to(logits.dtype)  # fmt: skip
    out = vocab_parallel_reverse_kl(
        logits, teacher, vocab_parallel_group, chunk_size, return_metrics=True
    )

    def canonical(local: Tensor) -> Tensor:
        if cp_size > 1:
            local = allgather_cp_sharded_tensor(local, context_parallel_group, seq_dim=1)
        return local[:, : seq_len - 1]

    loss_input: dict[str, Any] = {
        "opd_full_divergence": canonical(out.reverse_kl),
        "opd_full_entropy": canonical(out.neg_entropy.detach()),
        "opd_full_cross_entropy": canonical(out.cross_entropy.detach()),
    }
    if _reference_kl_penalty(loss_fn) != 0:
        loss_input["next_token_logprobs"] = next_token_logprobs(
            data["input_ids"], logits, vocab_parallel_rank, vocab_parallel_group,
            context_parallel_group, None, chunk_size,
        )  # fmt: skip
    return loss_input
