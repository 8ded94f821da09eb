"""``DRAFT`` (policy logits rolled left as the draft's teacher) and ``DISTILLATION`` inputs."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction
from lightning_mcore_rl.losses.loss_input._common import _group_size, _vocab_range
from lightning_mcore_rl.ops import (
    DistillationTopkLogprobs,
    get_distillation_topk_logprobs_from_logits,
)


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
    teacher = _roll_left(teacher)
    if d2t is not None:
        reverse_mapping = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        teacher = teacher[..., reverse_mapping]
    if "student_logits" not in data:
        raise ValueError("DRAFT loss input needs the draft model's `student_logits` in the data")
    return {
        "teacher_logits": teacher,
        "student_logits": data["student_logits"],
        "token_mask": _roll_left(cast(Tensor, data["token_mask"])),
    }


def _roll_left(tensor: Tensor) -> Tensor:
    """``tensor`` shifted left by one position along dim 1, the last position zeroed."""
    # A plain roll would bring position 0 into the last slot, scoring the last token against the
    # first one's logits (NeMo RL's roll_tensor zeroes it, docs/behaviour-reference.md §4.7).
    rolled = tensor.roll(-1, dims=1)
    rolled[:, -1] = 0
    return rolled


def _plain_distillation_topk_logprobs(
    logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
) -> DistillationTopkLogprobs:
    """Single-process top-k distillation inputs from full-vocab logits.

    The reference's non-parallel branch (docs/behaviour-reference.md §5.10), in the kernels'
    math dtype (fp32, fp64 kept): ``zero_outside_topk`` -> the student's full-vocab
    ``log_softmax`` at the teacher's ids and ``H_all = sum_v p log p``; otherwise the student's
    logits at the ids, log-softmaxed over the k ids. The teacher is log-softmaxed over its k
    logits; every output drops the last position.

    Args:
        logits: ``[B, S, V]`` student logits (temperature applied).
        teacher_topk_logits: ``[B, S, k]`` teacher logits at its top-k ids.
        teacher_topk_indices: ``[B, S, k]`` ids in ``[0, V)``.
        zero_outside_topk: see above.
        calculate_entropy: also return ``H_all`` (only with ``zero_outside_topk``, as the
            reference).

    Returns:
        :class:`DistillationTopkLogprobs`, each ``[B, S-1, ...]``.

    Raises:
        ValueError: the shapes disagree, ``k <= 0`` or an id is outside ``[0, V)``.
    """
    shape = tuple(teacher_topk_indices.shape)
    if len(shape) != 3 or shape[-1] <= 0:
        raise ValueError(
            f"topk must be positive: `teacher_topk_indices` must be [B, S, k] with k > 0, got "
            f"{shape}"
        )
    if (
        tuple(teacher_topk_logits.shape) != shape
        or logits.dim() != 3
        or logits.shape[:2] != shape[:2]
    ):
        raise ValueError(
            "without a vocab-parallel group `logits` must be the full [B, S, V] of "
            f"`teacher_topk_indices`/`teacher_topk_logits` [B, S, k] = {shape}, got logits "
            f"{tuple(logits.shape)} and teacher_topk_logits {tuple(teacher_topk_logits.shape)}"
        )
    vocab = logits.shape[-1]
    ids = teacher_topk_indices.to(logits.device).long()
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(
            f"`teacher_topk_indices` must lie in [0, V={vocab}) on the plain full-vocab path, got "
            f"ids in [{int(ids.min())}, {int(ids.max())}]"
        )
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    h_all = None
    if zero_outside_topk:
        logp = z.log_softmax(-1)  # [B, S, V]
        student = logp.gather(-1, ids)
        if calculate_entropy:
            h_all = (logp.exp() * logp).sum(-1)[:, :-1]  # [B, S-1]
    else:
        student = z.gather(-1, ids).log_softmax(-1)  # renormalised over the k ids
    teacher = teacher_topk_logits.to(student.device, student.dtype).log_softmax(-1)
    return DistillationTopkLogprobs(student[:, :-1], teacher[:, :-1], h_all)


def _distillation_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
) -> dict[str, Any]:
    """Student/teacher top-k logprobs ``[B, S-1, K]`` (+ ``H_all [B, S-1]``).

    See docs/behaviour-reference.md §5.10. ``vocab_parallel_group=None`` takes the plain path
    (full-vocab ``[B, S, V]`` logits, CP = 1).
    """
    if vocab_parallel_group is None and _group_size(context_parallel_group) > 1:
        raise ValueError(
            "DISTILLATION loss input with context parallelism needs `vocab_parallel_group` "
            "(the TP group); the plain path takes full-sequence, full-vocab logits"
        )
    cfg = cast(Any, loss_fn).cfg  # DISTILLATION losses carry a config (not in the protocol)
    teacher_logits = cast(Tensor, data["teacher_topk_logits"])
    teacher_indices = cast(Tensor, data["teacher_topk_indices"])
    calculate_entropy = cfg.zero_outside_topk and cfg.kl_type != "forward"
    if vocab_parallel_group is None:
        out = _plain_distillation_topk_logprobs(
            logits, teacher_logits, teacher_indices, cfg.zero_outside_topk, calculate_entropy
        )
    else:
        start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
        out = get_distillation_topk_logprobs_from_logits(
            logits, teacher_logits, teacher_indices, cfg.zero_outside_topk, calculate_entropy,
            start, end, vocab_parallel_group, context_parallel_group,
        )  # fmt: skip
    loss_input = {
        "student_topk_logprobs": out.student_topk_logprobs,
        "teacher_topk_logprobs": out.teacher_topk_logprobs,
    }
    if out.H_all is not None:
        loss_input["H_all"] = out.H_all
    return loss_input
