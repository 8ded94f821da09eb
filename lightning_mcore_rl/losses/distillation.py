"""Distillation losses: top-k KL and full-vocabulary on-policy distillation."""

# docs/behaviour-reference.md §4.5 (top-k KL) and §4.2 (`opd_full` mode). Both receive per-token
# quantities that `prepare_loss_input` computed with the vocab-parallel ops, so no process group
# appears here.

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.losses.config import (
    DistillationLossConfig,
    OPDFullLossConfig,
    load_config,
)
from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.utils import (
    LossAggregation,
    aggregate,
    base_masks,
    check_shape,
    get_tensor,
    masked_max,
    masked_mean,
    masked_min,
    reference_kl_term,
)

LOG_INFINITESIMAL = -100.0
"""Stand-in for log p_t of tokens outside the teacher's top-k (``zero_outside_topk``)."""


class DistillationLossFn:
    """Top-k KL distillation, token mean over the global batch, from student/teacher
    `*_topk_logprobs [B, S-1, K]` and (for the tail correction) `H_all [B, S-1]`.

    Args:
        cfg: A `DistillationLossConfig` or a mapping with its keys.
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION
    input_keys = ("token_mask", "teacher_topk_logits", "teacher_topk_indices")

    def __init__(self, cfg: DistillationLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = load_config(DistillationLossConfig, cfg)
        self.metric_normalizations = {
            "loss": MetricNormalizer.TOKENS,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    @property
    def needs_entropy(self) -> bool:
        """Whether the tail correction (and so `H_all`) is used."""
        return self.cfg.zero_outside_topk and self.cfg.kl_type != "forward"

    def per_token_kl(self, student: Tensor, teacher: Tensor, h_all: Tensor | None) -> Tensor:
        """`[B, S-1]` divergence of `[B, S-1, K]` top-k logprobs; `h_all [B, S-1]` is the
        student's full-vocabulary `sum p log p`."""
        # s/t: logprobs at the teacher's top-k ids (the teacher renormalised over its top-k)
        cfg = self.cfg
        p_s, p_t = student.exp(), teacher.exp()
        # forward sum_k P_t (t - s), reverse sum_k P_s (s - t), mixed w fwd + (1 - w) rev
        forward = (p_t * (teacher - student)).sum(-1)
        reverse = (p_s * (student - teacher)).sum(-1)
        if cfg.kl_type == "forward":
            return forward
        w = cfg.mixed_kl_weight if cfg.kl_type == "mixed" else 0.0
        per_token = w * forward + (1.0 - w) * reverse
        if self.needs_entropy:
            # zero_outside_topk (student logprobs over the full vocabulary) with a reverse part:
            # the tail outside the top-k adds H_rest - (-100) P_rest, H_rest = H_all - sum_k P_s s
            # (H_all = sum_v p log p, the negative entropy), P_rest = 1 - sum_k P_s
            assert h_all is not None
            h_rest = h_all - (p_s * student).sum(-1)
            p_rest = 1.0 - p_s.sum(-1)
            per_token = per_token + (1.0 - w) * (h_rest - LOG_INFINITESIMAL * p_rest)
        return per_token

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float,
        *,
        student_topk_logprobs: Tensor,
        teacher_topk_logprobs: Tensor,
        H_all: Tensor | None = None,  # noqa: N803 - the reference's loss-input name
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)` of `[B, S-1, K]` top-k logprobs (`global_valid_seqs` unused).

        Raises:
            ValueError: a shape differs, or `H_all` is missing where the tail correction needs it.
        """
        s, t = student_topk_logprobs, teacher_topk_logprobs
        if s.ndim != 3:
            raise ValueError(f"`student_topk_logprobs` must be [B, S-1, K], got {list(s.shape)}.")
        check_shape("teacher_topk_logprobs", t, tuple(s.shape))
        tm, sm = base_masks(data, s.shape[1], s.dtype)
        check_shape("student_topk_logprobs", s, (*tm.shape, s.shape[2]))
        if self.needs_entropy:
            if H_all is None:
                raise ValueError(
                    f"`zero_outside_topk=True` with kl_type={self.cfg.kl_type!r} needs the "
                    "`H_all` loss input [B, S-1]."
                )
            check_shape("H_all", H_all, tuple(tm.shape))
        per_token = self.per_token_kl(s, t, H_all)
        loss = masked_mean(per_token, tm * sm.unsqueeze(-1), None, global_valid_toks)
        # The reference reports the row count (its `data["input_ids"].shape[0]`), masked samples
        # included, unlike the other losses' `sum(sample_mask)`.
        rows = torch.tensor(float(s.shape[0]), dtype=s.dtype, device=s.device)
        return loss, detach_metrics({"loss": loss, "num_valid_samples": rows})


class OPDFullLossFn:
    """Full-vocabulary on-policy distillation: the exact per-token reverse KL
    `opd_full_divergence [B, S-1]` as the loss, plus an optional reference KL.

    Args:
        cfg: An `OPDFullLossConfig` or a mapping with its keys.
    """

    # `prepare_loss_input` computes D_t = sum_v p_s (log p_s - log p_t) at every position with
    # the chunked vocab-parallel kernel (gradient p_v (w_v - D) w.r.t. the student logits); this
    # loss only reduces it.

    input_type = LossInputType.OPD_FULL

    def __init__(self, cfg: OPDFullLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = load_config(OPDFullLossConfig, cfg)
        if self.cfg.reference_policy_kl_penalty != 0:
            warnings.warn(
                "OPDFullLossFn already minimises the KL to the teacher; a nonzero "
                "`reference_policy_kl_penalty` adds a second KL (to the reference policy).",
                stacklevel=2,
            )
        self.loss_type = (
            LossType.TOKEN_LEVEL if self.cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        )
        grad = MetricNormalizer.TOKENS if self.cfg.token_level_loss else MetricNormalizer.SEQUENCES
        self.metric_normalizations = {
            "loss": grad,
            "kl_penalty": grad,
            "opd_full_reverse_kl": MetricNormalizer.TOKENS,
            "opd_full_reverse_kl_min": MetricNormalizer.MIN,
            "opd_full_reverse_kl_max": MetricNormalizer.MAX,
            "opd_full_entropy": MetricNormalizer.TOKENS,
            "opd_full_cross_entropy": MetricNormalizer.TOKENS,
            "opd_full_decomposition_error": MetricNormalizer.MAX,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    @property
    def input_keys(self) -> tuple[str, ...]:
        """`token_mask`, `teacher_full_payload` and (reference KL) `reference_policy_logprobs`."""
        # a hidden-state payload's `teacher_index` is checked by its preparation
        keys: tuple[str, ...] = ("token_mask", "teacher_full_payload")
        if self.cfg.reference_policy_kl_penalty != 0:
            keys = (*keys, "reference_policy_logprobs")
        return keys

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        *,
        opd_full_divergence: Tensor,
        opd_full_entropy: Tensor | None = None,
        opd_full_cross_entropy: Tensor | None = None,
        next_token_logprobs: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)` from `[B, S-1]` per-token inputs; the entropy (`sum p_s log p_s`)
        and cross-entropy (`-sum p_s log p_t`) are metrics only, `next_token_logprobs`
        (unfiltered) is required iff the reference KL is on.

        Raises:
            ValueError: a shape differs, or `next_token_logprobs` is missing where needed.
        """
        cfg, div = self.cfg, opd_full_divergence
        if div.ndim != 2:
            raise ValueError(f"`opd_full_divergence` must be [B, S-1], got {list(div.shape)}.")
        tm, sm = base_masks(data, div.shape[1], div.dtype)
        check_shape("opd_full_divergence", div, tuple(tm.shape))
        mask = tm * sm.unsqueeze(-1)
        # mean(D) over global tokens, or over sequences of token means
        mode: LossAggregation = "token_mean" if cfg.token_level_loss else "seq_mean_token_mean"
        n_s, n_t = global_valid_seqs, global_valid_toks
        loss = aggregate(div, tm, sm, mode, n_s, n_t)
        kl = torch.zeros((), dtype=div.dtype)
        if cfg.reference_policy_kl_penalty != 0:
            if next_token_logprobs is None:
                raise ValueError(
                    f"`reference_policy_kl_penalty={cfg.reference_policy_kl_penalty}` needs the "
                    "`next_token_logprobs` loss input [B, S-1]."
                )
            check_shape("next_token_logprobs", next_token_logprobs, tuple(tm.shape))
            ref = get_tensor(data, "reference_policy_logprobs", (tm.shape[0], tm.shape[1] + 1))
            kl = reference_kl_term(
                next_token_logprobs,
                ref[:, 1:].to(div.dtype),
                tm,
                sm,
                beta=cfg.reference_policy_kl_penalty,
                kl_type=cfg.reference_policy_kl_type,
                input_clamp_value=cfg.kl_input_clamp_value,
                output_clamp_value=cfg.kl_output_clamp_value,
                aggregation=mode,
                global_valid_seqs=n_s,
                global_valid_toks=n_t,
            )
            loss = loss + kl
        metrics: dict[str, Tensor] = {
            "loss": loss,
            "kl_penalty": kl,
            "opd_full_reverse_kl": masked_mean(div, mask, None, n_t),
            "opd_full_reverse_kl_min": masked_min(div, mask),
            "opd_full_reverse_kl_max": masked_max(div, mask),
            "num_valid_samples": sm.sum(),
        }
        if cfg.reference_policy_kl_penalty != 0:
            metrics["kl_penalty"] = kl / cfg.reference_policy_kl_penalty
        if opd_full_entropy is not None:
            check_shape("opd_full_entropy", opd_full_entropy, tuple(tm.shape))
            # the input is the negative entropy: reported sign-flipped
            metrics["opd_full_entropy"] = -masked_mean(opd_full_entropy, mask, None, n_t)
        if opd_full_cross_entropy is not None:
            check_shape("opd_full_cross_entropy", opd_full_cross_entropy, tuple(tm.shape))
            metrics["opd_full_cross_entropy"] = masked_mean(opd_full_cross_entropy, mask, None, n_t)
        if opd_full_entropy is not None and opd_full_cross_entropy is not None:
            # max |(-H) + CE - KL|: KL = CE - H holds exactly, so this measures the kernels' error
            residual = (opd_full_entropy + opd_full_cross_entropy - div).abs()
            metrics["opd_full_decomposition_error"] = masked_max(residual, mask)
        return loss, detach_metrics(metrics)
