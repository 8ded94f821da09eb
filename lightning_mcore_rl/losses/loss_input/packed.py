"""Packed (THD) loss input in one fused pass (docs/behaviour-reference.md §3.3, §3.4)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction, LossInputType
from lightning_mcore_rl.losses.loss_input._common import (
    _as_ints,
    _filters,
    _finish_logprob_input,
    _group_rank,
    _group_size,
    _needs_entropy,
    _vocab_range,
)
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    from_parallel_logits_to_logprobs_packed_sequences,
    get_tokens_on_this_cp_rank,
    vocab_parallel_entropy,
)


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
        cu_seqlens_q: ``[B+1]`` sequence boundaries (may be the padded ones,
            docs/behaviour-reference.md trap 11).
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
        context_parallel_group: CP group (per-span all-gather when CP > 1,
            docs/behaviour-reference.md trap 3).

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
    """Loss input of a whole packed microbatch in one pass (``LOGPROB`` only).

    See docs/behaviour-reference.md §3.4.

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
    input_ids = cast(Tensor, data["input_ids"])  # [B, S] by the BatchedDataDict contract
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
