"""Shared pieces of loss-input preparation: group helpers and next-token logprobs/entropy."""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction, LossInputType
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    apply_top_k_top_p,
    from_parallel_logits_to_logprobs,
    vocab_parallel_entropy,
)
from lightning_mcore_rl.parallel import shard_range

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
    # TP shards the vocabulary contiguously: rank r holds [r * V/TP, (r + 1) * V/TP)
    rank = _group_rank(group) if vocab_parallel_rank is None else vocab_parallel_rank
    return shard_range(logits.shape[-1], rank)


def _reference_kl_penalty(loss_fn: LossFunction) -> float:
    """The loss's reference-KL beta (ClippedPG attribute or an OPD-full config), else 0."""
    if hasattr(loss_fn, "reference_policy_kl_penalty"):
        return float(loss_fn.reference_policy_kl_penalty)
    if loss_fn.input_type is LossInputType.OPD_FULL:
        # OPD_FULL losses carry their config as `cfg` (not part of the LossFunction protocol)
        return float(cast(Any, loss_fn).cfg.reference_policy_kl_penalty)
    return 0.0


def _needs_entropy(loss_fn: LossFunction) -> bool:
    # `entropy_coef` lives on ClippedPG's config, not in the LossFunction protocol
    return float(getattr(getattr(loss_fn, "cfg", None), "entropy_coef", 0.0)) > 0


def mask_out_neg_inf_logprobs(logprobs: Tensor, mask: Tensor, name: str) -> Tensor:
    """`logprobs [B, S-1]` with every `-inf` (a token top-k/top-p removed) set to 0, warning
    (as `name`) for those where `mask [B, S-1]` is valid."""
    # The positions still count in the loss normalisers (docs/behaviour-reference.md trap 9).
    # Masked positions are zeroed too: `0 * -inf` would poison the masked mean with NaN.
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
    """Single-process path: `[B, S-1]` `log_softmax(filter(logits[:, :-1]))` at `ids[:, 1:]`."""
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"without a vocab-parallel group `logits` must be the full [B, S, V] for `input_ids` "
            f"{tuple(input_ids.shape)}, got {tuple(logits.shape)}"
        )
    # position t scores token t + 1, so the last position scores nothing; fp32 for log_softmax
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
    """`[B, S-1]` fp32 next-token logprobs of `input_ids [B, S]` from `[B, S/CP, V/TP]` logits
    (temperature applied; `None` groups: TP = CP = 1, full-vocab logits)."""
    # docs/behaviour-reference.md §5.8
    if vocab_parallel_group is None:
        if _group_size(context_parallel_group) > 1:
            raise ValueError("context parallelism needs `vocab_parallel_group` (the TP group)")
        return _plain_next_token_logprobs(input_ids, logits, sampling_params)
    # filtering needs the whole row of the vocabulary at once: no chunking with top-k/top-p
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
    """`[B, S-1]` fp32 differentiable entropy `-sum_v p log p` of the distribution scoring
    token `t+1`, from `[B, S/CP, V/TP]` logits; `seq_len` is `S`."""
    if vocab_parallel_group is None:
        logp = logits[:, : seq_len - 1].float().log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)
    entropy = vocab_parallel_entropy(logits, vocab_parallel_group, chunk_size)
    # the kernel's output is CP-sharded like the logits; the loss needs the full sequence
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
    """`{"next_token_logprobs": ...}` after top-k/top-p `-inf` masking."""
    # docs/behaviour-reference.md §3.2
    if _filters(sampling_params):
        token_mask = cast(Tensor, data["token_mask"])  # tensors by the BatchedDataDict contract
        sample_mask = cast(Tensor, data["sample_mask"])
        mask = (token_mask * sample_mask.unsqueeze(-1))[:, 1:]
        logprobs = mask_out_neg_inf_logprobs(logprobs, mask, "curr_logprobs")
        if _reference_kl_penalty(loss_fn) != 0:
            # the reference KL compares full distributions: it reads logprobs computed without
            # the filter (a second pass, only when both are on)
            data["curr_logprobs_unfiltered"] = unfiltered()
    return {"next_token_logprobs": logprobs}


def logprob_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    sampling_params: TrainingSamplingParams | None,
    chunk_size: int | None,
) -> dict[str, Any]:
    """`LOGPROB` loss input: `next_token_logprobs [B, S-1]` (+ positive `entropy [B, S-1]` for
    an entropy bonus) from `[B, S/CP, V/TP]` logits or, with `use_fused_linear_logprobs`, the
    model's logprobs; `data` gains `curr_logprobs_unfiltered` with filtering + a reference KL."""
    # docs/behaviour-reference.md §3.2
    input_ids = cast(Tensor, data["input_ids"])  # [B, S] by the BatchedDataDict contract
    seq_len = input_ids.shape[1]
    groups = (vocab_parallel_rank, vocab_parallel_group, context_parallel_group)
    if getattr(loss_fn, "use_fused_linear_logprobs", False):
        # the fused LM head already returned next-token logprobs in place of logits
        logprobs = logits.float()[:, : seq_len - 1]
    else:
        logprobs = next_token_logprobs(input_ids, logits, *groups, sampling_params, chunk_size)
    # the unfiltered pass is a thunk: it runs only when filtering and a reference KL are both on
    loss_input = _finish_logprob_input(
        logprobs, data, loss_fn, sampling_params,
        lambda: next_token_logprobs(input_ids, logits, *groups, None, None),
    )  # fmt: skip
    if _needs_entropy(loss_fn):
        loss_input["entropy"] = next_token_entropy(
            logits, seq_len, vocab_parallel_group, context_parallel_group, chunk_size
        )
    return loss_input
