"""Full-vocabulary on-policy-distillation (`OPD_FULL`) loss input."""

# docs/behaviour-reference.md §3.5

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction
from lightning_mcore_rl.losses.loss_input._common import (
    OPD_FULL_PAYLOAD_FIELD,
    OPD_FULL_TEACHER_INDEX_FIELD,
    _group_rank,
    _group_size,
    _reference_kl_penalty,
    _vocab_range,
    next_token_logprobs,
)
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    get_tokens_on_this_cp_rank,
    vocab_parallel_reverse_kl,
)
from lightning_mcore_rl.parallel import host_ints


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
    """This rank's detached teacher logits `[B, S/CP, V/TP]` from a `[B, S, D]` payload."""
    batch, local_seq, local_vocab = local_shape
    # padded to the student's CP-padded width, then cut to this CP rank's zigzag shard
    padded = F.pad(payload, (0, 0, 0, local_seq * cp_size - payload.shape[1]))
    window = get_tokens_on_this_cp_rank(padded, cp_rank, cp_size, seq_dim=1)  # [B, S/CP, D]
    if weights is None:
        # a logits payload (D = V): this TP rank's vocabulary slice
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
    # a hidden-state payload (D = H_t): each row projected with its own teacher's LM-head shard
    index = host_ints(data[OPD_FULL_TEACHER_INDEX_FIELD])
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
    """`OPD_FULL` loss input from student logits `[B, S/CP, V/TP]` and the teacher payload
    `data["teacher_full_payload"] [B, S, D]`: `opd_full_divergence` (differentiable),
    `opd_full_entropy` and `opd_full_cross_entropy` (metrics), all `[B, S-1]`, plus unfiltered
    `next_token_logprobs` when the loss has a reference KL.

    Raises:
        NotImplementedError: no vocab-parallel group.
        ValueError: the payload column is missing or malformed.
    """
    # The payload is the teacher's logits (D = V) without `teacher_output_layer_weight_by_index`,
    # else its pre-LM-head hidden states (D = H_t), projected with the `[V/TP, H_t]` shard that
    # `data["teacher_index"] [B]` picks. `sampling_params` is unused: the divergence is an exact
    # expectation over the vocabulary, not a sample; the argument stays for the seed's API.
    if vocab_parallel_group is None:
        raise NotImplementedError("OPD_FULL loss input needs `vocab_parallel_group` (TP group)")
    if OPD_FULL_PAYLOAD_FIELD not in data:
        raise ValueError(
            f"OPD_FULL loss input needs the teacher payload column `{OPD_FULL_PAYLOAD_FIELD}` "
            f"[B, S, D]; keys: {sorted(data)}"
        )
    cp_rank, cp_size = _group_rank(context_parallel_group), _group_size(context_parallel_group)
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
    input_ids = cast(Tensor, data["input_ids"])  # [B, S] by the BatchedDataDict contract
    seq_len = input_ids.shape[1]
    payload = cast(Tensor, data[OPD_FULL_PAYLOAD_FIELD])  # the [B, S, D] payload tensor
    teacher = _teacher_logits_shard(
        payload, data, logits.shape, start, end, cp_rank, cp_size,
        _group_size(vocab_parallel_group), teacher_output_layer_weight_by_index,
    ).to(logits.dtype)  # fmt: skip
    out = vocab_parallel_reverse_kl(
        logits, teacher, vocab_parallel_group, chunk_size, return_metrics=True
    )

    # the kernel's outputs are CP-sharded like the logits; the loss reads [B, S-1]
    def canonical(local: Tensor) -> Tensor:
        if cp_size > 1:
            local = allgather_cp_sharded_tensor(local, context_parallel_group, seq_dim=1)
        return local[:, : seq_len - 1]

    assert out.neg_entropy is not None and out.cross_entropy is not None  # return_metrics=True
    loss_input: dict[str, Any] = {
        "opd_full_divergence": canonical(out.reverse_kl),
        "opd_full_entropy": canonical(out.neg_entropy.detach()),
        "opd_full_cross_entropy": canonical(out.cross_entropy.detach()),
    }
    if _reference_kl_penalty(loss_fn) != 0:
        # unfiltered (no sampling params): the reference KL scores the policy itself
        loss_input["next_token_logprobs"] = next_token_logprobs(
            input_ids, logits, vocab_parallel_rank, vocab_parallel_group,
            context_parallel_group, None, chunk_size,
        )  # fmt: skip
    return loss_input
