"""Exact global top-k over TP vocab shards, gathers at global ids, and the top-k distillation inputs."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mcore_rl.ops._checks import (
    all_reduce,
    check_chunk_size,
    check_ndim,
    check_token_ids,
    check_vocab_shard,
    compute_dtype,
    group_rank_size,
    seq_chunks,
    upcast,
)
from lightning_mcore_rl.ops.context_parallel import (
    allgather_cp_sharded_tensor,
    get_tokens_on_this_cp_rank,
)
from lightning_mcore_rl.ops.vocab_parallel import (
    distributed_logprobs_at_indices,
    localise_ids,
    vocab_parallel_entropy,
)

_BLOCK_BYTES = 64 * 2**20  # fp32 scatter block of the low-precision gather backward


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"topk must be positive, got k = {k!r}")


def _all_gather_last_dim(t: torch.Tensor, tp_group: Any) -> torch.Tensor:
    if tp_group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp_group.size())]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def distributed_vocab_topk(
    logits: torch.Tensor,
    k: int,
    tp_group: Any,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over the full vocab of TP-sharded `logits [..., S, V/TP]` (no grad):
    `(values [..., S, k'] fp32, indices [..., S, k'] int64 global ids)`, `k' = min(k, V)`, values
    sorted descending, identical on every TP rank (`chunk_size=None`: one chunk)."""
    _check_k(k)
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    check_chunk_size(chunk_size)
    if logits.dim() < 2:
        raise ValueError(f"`logits` must be [..., S, V_l], got shape {tuple(logits.shape)}")
    local_vocab = logits.shape[-1]
    k_global, k_local = min(k, local_vocab * tp_size), min(k, local_vocab)
    out_shape = (*logits.shape[:-1], k_global)
    values = torch.empty(out_shape, dtype=compute_dtype(logits.dtype), device=logits.device)
    indices = torch.empty(out_shape, dtype=torch.long, device=logits.device)
    for start, stop in seq_chunks(logits.shape[-2], chunk_size):
        # local top-min(k, V/TP) in fp32, shifted to global ids, all-gathered over TP; the
        # top-min(k, V) of the union is exact
        local_vals, local_ids = upcast(logits.narrow(-2, start, stop - start)).topk(k_local, dim=-1)
        all_vals = _all_gather_last_dim(local_vals, tp_group)
        all_ids = _all_gather_last_dim(local_ids + vocab_start_index, tp_group)
        top_vals, where = all_vals.topk(k_global, dim=-1)
        values.narrow(-2, start, stop - start).copy_(top_vals)
        indices.narrow(-2, start, stop - start).copy_(all_ids.gather(-1, where))
    return values, indices


class _GatherAtGlobalIndices(torch.autograd.Function):
    """`logits [..., V/TP]` at global `ids [..., K]` -> `[..., K]` fp32, vocab-parallel."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        ids: torch.Tensor,
        vocab_start: int,
        vocab_end: int,
        tp_group: Any,
    ) -> torch.Tensor:
        owned, local = localise_ids(ids, vocab_start, vocab_end)
        picked = upcast(logits.gather(-1, local))
        # 0 where this shard does not own the id: the SUM over TP hands every rank the owner's value
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        all_reduce(picked, tp_group, dist.ReduceOp.SUM)
        ctx.save_for_backward(owned, local)
        ctx.logits_meta = (logits.shape, logits.dtype, logits.device)
        return picked

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owned, local = ctx.saved_tensors
        shape, dtype, device = ctx.logits_meta
        math_dtype = compute_dtype(dtype)
        # scatter_add of g at owned ids (duplicates accumulate), no collective. For bf16/fp16 logits
        # the scatter runs in fp32 blocks of at most 64 MiB, each rounded once into the gradient: no
        # full fp32 [..., V/TP] buffer
        g = torch.where(owned, grad_output.to(math_dtype), 0.0).reshape(-1, local.shape[-1])
        ids = local.reshape(-1, local.shape[-1])
        if math_dtype == dtype:
            grad = torch.zeros(ids.shape[0], shape[-1], dtype=dtype, device=device)
            return grad.scatter_add_(-1, ids, g).view(shape), None, None, None, None
        grad = torch.empty(ids.shape[0], shape[-1], dtype=dtype, device=device)
        # blocks of rows: the fp32 scatter buffer stays within _BLOCK_BYTES whatever the vocab
        rows = max(1, _BLOCK_BYTES // (shape[-1] * torch.finfo(math_dtype).bits // 8))
        for start, stop in seq_chunks(ids.shape[0], rows):
            block = torch.zeros(stop - start, shape[-1], dtype=math_dtype, device=device)
            block.scatter_add_(-1, ids[start:stop], g[start:stop])
            grad[start:stop].copy_(block)  # the one rounding to the logits' dtype
        return grad.view(shape), None, None, None, None


def _pad_and_shard_ids(
    indices: torch.Tensor, local_seq_len: int, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """`[B, S, K]` -> right-pad `S` with id 0 to `S_l * CP` and take this rank's zigzag shard."""
    padded = F.pad(indices, (0, 0, 0, local_seq_len * cp_size - indices.shape[1]))
    return get_tokens_on_this_cp_rank(padded, cp_rank, cp_size, seq_dim=1)


def _check_indices(
    logits: torch.Tensor, indices: torch.Tensor, tp_size: int, cp_size: int, name: str
) -> None:
    check_ndim(logits, 3, "logits", "[B, S/CP, V_l]")
    check_ndim(indices, 3, name, "[B, S, K]")
    batch, local_seq, local_vocab = logits.shape
    if indices.shape[0] != batch or indices.shape[1] > local_seq * cp_size:
        raise ValueError(
            f"`{name}` {tuple(indices.shape)} must be [B, S, K] with B = {batch} and S <= S_local * "
            f"CP = {local_seq * cp_size}"
        )
    # a zigzag shard is two equal chunks
    if cp_size > 1 and local_seq % 2 != 0:
        raise ValueError(
            f"S_local * CP = {local_seq * cp_size} must be divisible by 2*CP = {2 * cp_size}"
        )
    if indices.shape[-1] <= 0:
        raise ValueError(f"topk must be positive, got K = {indices.shape[-1]} in `{name}`")
    check_token_ids(indices, local_vocab * tp_size, name)


def gather_logits_at_global_indices(
    logits: torch.Tensor,
    indices: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    cp_group: Any = None,
) -> torch.Tensor:
    """Differentiable gather of this rank's CP and vocab shard `logits [B, S/CP, V/TP]` at global
    `indices [B, S, K]` (unsharded, `S <= S/CP * CP`): `[B, S, K]` fp32 in token order, identical on
    every TP/CP rank."""
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    _check_indices(logits, indices, tp_size, cp_size, "indices")
    local_ids = _pad_and_shard_ids(indices, logits.shape[1], cp_rank, cp_size)
    out = _GatherAtGlobalIndices.apply(
        logits, local_ids, vocab_start_index, vocab_end_index, tp_group
    )
    if cp_size > 1:
        out = allgather_cp_sharded_tensor(out, cp_group, seq_dim=1)
    return out[:, : indices.shape[1]]


class DistillationTopkLogprobs(NamedTuple):
    """Top-k distillation inputs, next-token aligned: student and teacher logprobs
    `[B, S-1, k]` fp32 at the teacher's ids, and `H_all [B, S-1]` fp32 (the student's
    `sum_v p log p`, the NEGATIVE entropy, reference name) or `None`."""

    student_topk_logprobs: torch.Tensor
    teacher_topk_logprobs: torch.Tensor
    H_all: torch.Tensor | None


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    cp_group: Any = None,
) -> DistillationTopkLogprobs:
    """Student and teacher logprobs `[B, S-1, k]` at the teacher's top-k ids
    (docs/behaviour-reference.md §5.10) from the student's shard `[B, S/CP, V/TP]` (temperature
    applied) and the teacher's `[B, S, k]` logits and global ids.

    Args:
        zero_outside_topk: the student's full-vocab logprobs at the ids; else its logits at the ids
            renormalised over the k ids.
        calculate_entropy: also return `H_all` (`sum p log p` of the student, full vocab).

    Raises:
        ValueError: teacher shapes or dtype do not match, or bad ids.
    """
    if teacher_topk_indices.dim() != 3 or teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(
            f"topk must be positive: `teacher_topk_indices` must be [B, S, k] with k > 0, got "
            f"{tuple(teacher_topk_indices.shape)}"
        )
    if teacher_topk_logits.shape != teacher_topk_indices.shape:
        raise ValueError(
            f"`teacher_topk_logits` {tuple(teacher_topk_logits.shape)} and `teacher_topk_indices` "
            f"{tuple(teacher_topk_indices.shape)} must have the same [B, S, k] shape"
        )
    if not teacher_topk_logits.is_floating_point():
        raise ValueError(f"`teacher_topk_logits` must be float, got {teacher_topk_logits.dtype}")
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    _, tp_size = check_vocab_shard(student_logits, vocab_start_index, vocab_end_index, tp_group)
    _check_indices(student_logits, teacher_topk_indices, tp_size, cp_size, "teacher_topk_indices")
    seq_len, local_seq = teacher_topk_indices.shape[1], student_logits.shape[1]
    chunk = max(1, min(local_seq, 1024))

    def canonical(local: torch.Tensor) -> torch.Tensor:
        if cp_size > 1:
            local = allgather_cp_sharded_tensor(local, cp_group, seq_dim=1)
        return local[:, : seq_len - 1]

    # full-vocab logprobs at the ids: the mass outside the top-k is accounted for by `H_all`; the
    # teacher is always renormalised over its k logits
    if zero_outside_topk:
        local_ids = _pad_and_shard_ids(teacher_topk_indices, local_seq, cp_rank, cp_size)
        student = canonical(
            distributed_logprobs_at_indices(
                student_logits, local_ids, vocab_start_index, vocab_end_index, tp_group, chunk
            )
        )
    else:
        picked = gather_logits_at_global_indices(
            student_logits, teacher_topk_indices, vocab_start_index, vocab_end_index, tp_group,
            cp_group,
        )  # fmt: skip
        # the student renormalised over the teacher's k ids (mass outside them ignored)
        student = F.log_softmax(picked, dim=-1)[:, : seq_len - 1]
    neg_entropy = None
    if calculate_entropy:
        # the reference's `H_all` is sum p log p, the negative of the entropy
        neg_entropy = canonical(-vocab_parallel_entropy(student_logits, tp_group, chunk))
    teacher = F.log_softmax(upcast(teacher_topk_logits), dim=-1)[:, : seq_len - 1]
    return DistillationTopkLogprobs(student, teacher, neg_entropy)
