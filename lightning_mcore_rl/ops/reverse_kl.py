"""Full-vocabulary reverse KL between vocab-parallel student and teacher logits (on-policy
distillation), with the negative entropy and cross entropy as metrics."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_mcore_rl.ops._checks import (
    all_reduce,
    check_chunk_size,
    check_vocab_shard,
    compute_dtype,
    group_rank_size,
    seq_chunks,
    upcast,
)
from lightning_mcore_rl.ops.vocab_parallel import global_logsumexp
from lightning_mcore_rl.parallel import shard_range

# all three per-token quantities are expectations under the student, F = sum_v p_v w_v: reverse KL w
# = log p_s - log p_t, negative entropy w = log p_s, cross entropy w = -log p_t; dF/dz_v = p_v (w_v
# - F) (docs/behaviour-reference.md §3.5). Only the reverse KL is differentiable here
_SUM = dist.ReduceOp.SUM


class ReverseKLOutput(NamedTuple):
    """Per-token outputs of `vocab_parallel_reverse_kl`, each `[..., S]` fp32: `reverse_kl`
    (differentiable w.r.t. the student), `neg_entropy` `sum p_s log p_s` and `cross_entropy`
    `-sum p_s log p_t` (`None` unless requested)."""

    reverse_kl: torch.Tensor
    neg_entropy: torch.Tensor | None
    cross_entropy: torch.Tensor | None


def _log_probs(logits: torch.Tensor, start: int, stop: int, lse: torch.Tensor) -> torch.Tensor:
    """fp32 `log p` of the seq chunk `[start, stop)` given its `lse [..., stop-start]`."""
    # out of place: ``.float()`` of fp32 logits is the caller's tensor itself
    return upcast(logits.narrow(-2, start, stop - start)) - lse.unsqueeze(-1)


class _ChunkedReverseKL(torch.autograd.Function):
    """`student`, `teacher [..., S, V/TP]` -> reverse KL, `sum p log p`, `-sum p log q`, each
    `[..., S]` fp32 (the last two empty unless requested), chunked along `S`."""

    @staticmethod
    def forward(
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        chunk_size: int | None,
        with_metrics: bool,
        tp_group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = student.shape[:-1]
        lse_s = torch.empty(shape, dtype=compute_dtype(student.dtype), device=student.device)
        lse_t = torch.empty_like(lse_s)
        sums = torch.zeros(
            (3 if with_metrics else 1, *shape), dtype=lse_s.dtype, device=student.device
        )
        for start, stop in seq_chunks(student.shape[-2], chunk_size):
            for logits, lse in ((student, lse_s), (teacher, lse_t)):
                chunk = upcast(logits.narrow(-2, start, stop - start))
                lse.narrow(-1, start, stop - start).copy_(global_logsumexp(chunk, tp_group))
            logp_s = _log_probs(student, start, stop, lse_s.narrow(-1, start, stop - start))
            logp_t = _log_probs(teacher, start, stop, lse_t.narrow(-1, start, stop - start))
            p_s = logp_s.exp()
            sums[0].narrow(-1, start, stop - start).copy_((p_s * (logp_s - logp_t)).sum(-1))
            if with_metrics:
                sums[1].narrow(-1, start, stop - start).copy_((p_s * logp_s).sum(-1))
                sums[2].narrow(-1, start, stop - start).copy_(-(p_s * logp_t).sum(-1))
        # local partial sums per chunk, one all-reduce over TP at the end
        all_reduce(sums, tp_group, _SUM)
        reverse_kl = sums[0]
        extra = (sums[1], sums[2]) if with_metrics else (sums[:0], sums[:0])
        ctx.mark_non_differentiable(*extra)
        ctx.save_for_backward(student, teacher, lse_s, lse_t, reverse_kl)
        ctx.chunk_size = chunk_size
        return reverse_kl, *extra

    @staticmethod
    def backward(
        ctx: Any, grad_kl: torch.Tensor, *unused: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        student, teacher, lse_s, lse_t, reverse_kl = ctx.saved_tensors
        g = upcast(grad_kl)
        grad = torch.empty_like(student)
        for start, stop in seq_chunks(student.shape[-2], ctx.chunk_size):
            n = stop - start
            logp_s = _log_probs(student, start, stop, lse_s.narrow(-1, start, n))
            w = logp_s - _log_probs(teacher, start, stop, lse_t.narrow(-1, start, n))
            # dF/dz_v = g * p_v (log p_v - log q_v - F), p recomputed per chunk, the teacher
            # constant; no collective
            w.sub_(reverse_kl.narrow(-1, start, n).unsqueeze(-1)).mul_(logp_s.exp_())
            grad.narrow(-2, start, n).copy_(w.mul_(g.narrow(-1, start, n).unsqueeze(-1)))
        return grad, None, None, None, None


def vocab_parallel_reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    tp_group: Any,
    chunk_size: int | None = None,
    return_metrics: bool = False,
) -> ReverseKLOutput:
    """Per-token full-vocab `KL(p_student || p_teacher)` of `[..., S, V/TP]` shards, vocab-parallel
    and chunked (`chunk_size=None`: one chunk); identical on every TP rank. The teacher is a
    constant; `return_metrics` adds the two no-gradient metrics of `ReverseKLOutput`.

    Raises:
        ValueError: the two logits differ in shape or dtype, or are not `[..., S, V/TP]`.
    """
    if student_logits.dim() < 2:
        raise ValueError(
            f"`student_logits` must be [..., S, V_l], got shape {tuple(student_logits.shape)}"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"`student_logits` {tuple(student_logits.shape)} and `teacher_logits` "
            f"{tuple(teacher_logits.shape)} must have the same [..., S, V_l] shape"
        )
    if student_logits.dtype != teacher_logits.dtype:
        raise ValueError(
            f"dtype mismatch: `student_logits` is {student_logits.dtype} but `teacher_logits` is "
            f"{teacher_logits.dtype}; cast the teacher to the student's dtype"
        )
    check_chunk_size(chunk_size)
    tp_rank, _ = group_rank_size(tp_group, "tp_group")
    # the bounds follow from the rank: this kernel takes no vocab range, only the shard
    check_vocab_shard(
        student_logits, *shard_range(student_logits.shape[-1], tp_rank), tp_group,
        name="student_logits",
    )  # fmt: skip
    kl, neg_entropy, cross_entropy = _ChunkedReverseKL.apply(
        # the teacher is a constant of the loss: no gradient flows to it
        student_logits,
        teacher_logits.detach(),
        chunk_size,
        return_metrics,
        tp_group,
    )
    if not return_metrics:
        return ReverseKLOutput(kl, None, None)
    return ReverseKLOutput(kl, neg_entropy, cross_entropy)
