"""``DRAFT`` (policy logits rolled left as the draft's teacher) and ``DISTILLATION`` inputs."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.interfaces import LossFunction
from lightning_mcore_rl.losses.loss_input._common import _group_size, _vocab_range
from lightning_mcore_rl.ops import get_distillation_topk_logprobs_from_logits


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
        "token_mask": cast(Tensor, data["token_mask"]).roll(-1, dims=1),
    }


def _distillation_loss_input(
    logits: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
) -> dict[str, Any]:
    """Student/teacher top-k logprobs ``[B, S-1, K]`` (+ ``H_all [B, S-1]``).

    See docs/behaviour-reference.md §5.10.
    """
    if vocab_parallel_group is None:
        raise ValueError("DISTILLATION loss input needs `vocab_parallel_group` (the TP group)")
    cfg = cast(Any, loss_fn).cfg  # DISTILLATION losses carry a config (not in the protocol)
    start, end = _vocab_range(logits, vocab_parallel_rank, vocab_parallel_group)
    out = get_distillation_topk_logprobs_from_logits(
        logits, cast(Tensor, data["teacher_topk_logits"]),
        cast(Tensor, data["teacher_topk_indices"]),
        cfg.zero_outside_topk, cfg.zero_outside_topk and cfg.kl_type != "forward",
        start, end, vocab_parallel_group, context_parallel_group,
    )  # fmt: skip
    loss_input = {
        "student_topk_logprobs": out.student_topk_logprobs,
        "teacher_topk_logprobs": out.teacher_topk_logprobs,
    }
    if out.H_all is not None:
        loss_input["H_all"] = out.H_all
    return loss_input
