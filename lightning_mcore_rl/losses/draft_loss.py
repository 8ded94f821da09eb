"""Soft cross-entropy of a draft (EAGLE) model against the policy's own logits."""

# docs/behaviour-reference.md §4.7

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.utils import check_shape, get_tensor, masked_mean


class DraftCrossEntropyLossFn:
    """`sum_t m_t * (-sum_v softmax(teacher)_v log_softmax(student)_v) / N_t`; reads
    `sample_mask [B]`, `token_mask [B, S]`, `student_logits [B, S, V]`, and gets
    `teacher_logits [B, S, V]` and the rolled `token_mask [B, S]` as loss inputs."""

    # the teacher (policy) logits are detached: d/d student = (softmax(s) - softmax(t)) m_t / N_t;
    # `prepare_loss_input` rolls teacher logits and mask left by one so position t of both
    # models scores the same token
    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DRAFT
    input_keys = ("token_mask", "student_logits")

    def __init__(self) -> None:
        self.metric_normalizations = {
            "loss": MetricNormalizer.TOKENS,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float,
        *,
        teacher_logits: Tensor,
        student_logits: Tensor,
        token_mask: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)` from the rolled policy logits and the draft's, both `[B, S, V]`, the
        rolled `token_mask [B, S]` and `N_t` (`global_valid_toks`) of the global batch."""
        # `global_valid_seqs` is unused: a token-level loss, the argument is the protocol's
        if student_logits.ndim != 3:
            raise ValueError(
                f"`student_logits` must be [B, S, V], got {list(student_logits.shape)}."
            )
        check_shape("teacher_logits", teacher_logits, tuple(student_logits.shape))
        batch, width, _ = student_logits.shape
        check_shape("token_mask", token_mask, (batch, width))
        sample_mask = get_tensor(data, "sample_mask", (batch,))
        target = torch.softmax(teacher_logits.detach().to(student_logits.dtype), dim=-1)
        per_token = -(target * torch.log_softmax(student_logits, dim=-1)).sum(-1)  # [B, S]
        dtype = student_logits.dtype
        mask = token_mask.to(dtype) * sample_mask.to(dtype).unsqueeze(-1)
        loss = masked_mean(per_token, mask, None, global_valid_toks)
        return loss, detach_metrics({"loss": loss, "num_valid_samples": sample_mask.sum()})
