"""Packed (THD) loss input in one fused pass."""

# docs/behaviour-reference.md §3.3, §3.4

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction, LossInputType
from lightning_mcore_rl.losses.loss_input._common import (
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
from lightning_mcore_rl.parallel import host_ints


def _pack_input_ids(
    input_ids: Tensor,
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_q_padded: Tensor | Sequence[int],
    cp_rank: int = 0,
    cp_size: int = 1,
    roll_shift: int = 0,
) -> Tensor:
    """Right-padded `[B, S]` ids packed into this CP rank's `[1, T/CP]` THD row
    (`T = cu_seqlens_q_padded[-1]`), each `[B+1]`-bounded span rolled by `roll_shift`.

    Each span must be a multiple of `2*CP`; `roll_shift=-1` gives next-token targets.
    """
    # cu_seqlens_q may be the padded boundaries (docs/behaviour-reference.md trap 11); the roll
    # is per span, so a target never crosses into the next sequence.
    cu_q, cu_qp = host_ints(cu_seqlens_q), host_ints(cu_seqlens_q_padded)
    width = input_ids.shape[1]
    out = input_ids.new_zeros(1, cu_qp[-1] // cp_size)
    for i in range(len(cu_qp) - 1):
        padded = cu_qp[i + 1] - cu_qp[i]
        if padded == 0:
            continue
        # the span's first min(len_i, S) tokens, then zeros: bin-fill padding may make len_i > S
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
    """This CP rank's packed per-token values `[T/CP]` (per-span zigzag shards) -> `[B, S-1]`,
    each span's last position dropped and zeros past `min(len - 1, S - 1)`; `width` is `S`."""
    cp_size = _group_size(context_parallel_group)
    rows = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True):
        # a span of len tokens scores len - 1 next tokens, and the row holds at most S - 1
        n = max(0, min(end - start - 1, width - 1))
        span = values[start // cp_size : end // cp_size]
        if n and cp_size > 1:
            # a zigzag shard is per span: gather span by span (docs/behaviour-reference.md trap 3)
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
    """`(loss_input, data)` of a whole packed microbatch in one pass: `next_token_logprobs
    [B, S-1]` (+ `entropy`) from `[1, T/CP, V/TP]` logits, for a `LOGPROB` loss only.

    Raises:
        ValueError: a non-`LOGPROB` loss or no TP group.
    """
    # docs/behaviour-reference.md §3.4; `cu_seqlens_q*` are `[B+1]` host ints or a CPU tensor.
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
    cu_qp = host_ints(cu_seqlens_q_padded)
    # targets rolled once here, in the packed layout the logits have (`target_is_pre_rolled`)
    targets = _pack_input_ids(input_ids, cu_seqlens_q, cu_qp, cp_rank, cp_size, roll_shift=-1)
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)

    def logprobs_with(params: TrainingSamplingParams | None, chunk: int | None) -> Tensor:
        # filtering needs whole vocabulary rows; unchunked, the kernel wants fp32 logits
        use_chunking = chunk is not None and not _filters(params)
        return from_parallel_logits_to_logprobs_packed_sequences(
            logits if use_chunking else logits.float(), targets, cu_qp, width, start, end,
            vocab_parallel_group, inference_only=False, cp_group=context_parallel_group,
            chunk_size=chunk if use_chunking else None, sampling_params=params,
            target_is_pre_rolled=True,
        )  # fmt: skip

    # the unfiltered pass is a thunk: it runs only when filtering and a reference KL are both on
    loss_input = _finish_logprob_input(
        logprobs_with(sampling_params, chunk_size), data, loss_fn, sampling_params,
        lambda: logprobs_with(None, None),
    )  # fmt: skip
    if _needs_entropy(loss_fn):
        entropy = vocab_parallel_entropy(logits, vocab_parallel_group, chunk_size)[0]  # [T/CP]
        loss_input["entropy"] = unpack_per_token(entropy, cu_qp, width, context_parallel_group)
    return loss_input, data
