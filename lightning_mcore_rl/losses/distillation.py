"""Distillation losses: top-k KL and full-vocabulary on-policy distillation.

Behaviour: docs/behaviour-reference.md §4.5 (top-k KL) and §4.2 (``opd_full`` mode).

Both receive per-token quantities computed by ``prepare_loss_input`` with the vocab-parallel ops,
so no process group appears here.
"""

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
    """Top-k KL distillation, token mean over the global batch.

    With ``s``/``t`` the student/teacher logprobs at the teacher's top-k ids ``[B, S-1, K]``
    (the teacher renormalised over its top-k), ``P = exp``: forward ``sum_k P_t (t - s)``,
    reverse ``sum_k P_s (s - t)``, mixed ``w fwd + (1 - w) rev``. With ``zero_outside_topk``
    (student logprobs over the full vocabulary) and a reverse component, the tail outside the
    top-k adds ``H_rest - (-100) P_rest`` per token, ``H_rest = H_all - sum_k P_s s``,
    ``P_rest = 1 - sum_k P_s`` (scaled by ``1 - w`` for mixed), where ``H_all = sum_v p log p``
    over the full student vocabulary (negative entropy).

    Args:
        cfg: A :class:`DistillationLossConfig` or a mapping with its keys.

    Inputs (``data``): ``token_mask [B, S]``, ``sample_mask [B]``. Loss inputs:
    ``student_topk_logprobs [B, S-1, K]``, ``teacher_topk_logprobs [B, S-1, K]``,
    ``H_all [B, S-1]`` (required for the tail correction). Metrics: ``loss`` and
    ``num_valid_samples = B``, every row of the microbatch, masked ones included (as the
    reference reports it).
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
        """Whether the tail correction (and so ``H_all``) is used."""
        return self.cfg.zero_outside_topk and self.cfg.kl_type != "forward"

    def per_token_kl(self, student: Tensor, teacher: Tensor, h_all: Tensor | None) -> Tensor:
        """The per-token divergence ``[B, S-1]`` (see the class docstring).

        Args:
            student: ``[B, S-1, K]`` student top-k logprobs.
            teacher: ``[B, S-1, K]`` teacher top-k logprobs.
            h_all: ``[B, S-1]`` full-vocabulary ``sum p log p`` of the student.

        Returns:
            ``[B, S-1]`` per-token loss.
        """
        cfg = self.cfg
        p_s, p_t = student.exp(), teacher.exp()
        forward = (p_t * (teacher - student)).sum(-1)
        reverse = (p_s * (student - teacher)).sum(-1)
        if cfg.kl_type == "forward":
            return forward
        w = cfg.mixed_kl_weight if cfg.kl_type == "mixed" else 0.0
        per_token = w * forward + (1.0 - w) * reverse
        if self.needs_entropy:
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
        """Compute the distillation loss.

        Args:
            data: The microbatch.
            global_valid_seqs: Unused; part of the protocol.
            global_valid_toks: ``N_t`` over the whole global batch.
            student_topk_logprobs: ``[B, S-1, K]``.
            teacher_topk_logprobs: ``[B, S-1, K]``.
            H_all: ``[B, S-1]`` student ``sum_v p log p``.

        Returns:
            ``(loss, metrics)``.
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
    """Full-vocabulary on-policy distillation: the exact per-token reverse KL as the loss.

    ``prepare_loss_input`` computes ``D_t = sum_v p_s (log p_s - log p_t)`` for every position
    with the chunked vocab-parallel kernel (gradient ``p_v (w_v - D)`` w.r.t. the student
    logits); this loss only reduces it: ``mean(D)`` over global tokens, or over sequences of
    token means with ``token_level_loss=False``, plus an optional reference KL.

    Args:
        cfg: An :class:`OPDFullLossConfig` or a mapping with its keys.

    Inputs (``data``): ``token_mask [B, S]``, ``sample_mask [B]``,
    ``reference_policy_logprobs [B, S]`` when beta != 0. Loss inputs:
    ``opd_full_divergence [B, S-1]`` (differentiable); optional ``opd_full_entropy [B, S-1]``
    (``sum_v p_s log p_s``, the negative entropy, reported sign-flipped) and
    ``opd_full_cross_entropy [B, S-1]`` (``-sum_v p_s log p_t``); ``next_token_logprobs
    [B, S-1]`` (unfiltered) when beta != 0.
    """

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
        """``token_mask``, the teacher's ``teacher_full_payload`` and, with a reference KL,
        ``reference_policy_logprobs`` (a hidden-state payload's ``teacher_index`` is checked
        by its preparation)."""
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
        """Compute the full-vocabulary distillation loss.

        Args:
            data: The microbatch.
            global_valid_seqs: ``N_s`` over the whole global batch.
            global_valid_toks: ``N_t`` over the whole global batch.
            opd_full_divergence: ``[B, S-1]`` per-token reverse KL.
            opd_full_entropy: ``[B, S-1]`` per-token ``sum p_s log p_s`` (metric only).
            opd_full_cross_entropy: ``[B, S-1]`` per-token ``-sum p_s log p_t`` (metric only).
            next_token_logprobs: ``[B, S-1]`` unfiltered logprobs, required iff beta != 0.

        Returns:
            ``(loss, metrics)``; entropy/cross-entropy metrics only when given, the
            decomposition error ``max |entropy + CE - KL|`` only when both are given.
        """
        cfg, div = self.cfg, opd_full_divergence
        if div.ndim != 2:
            raise ValueError(f"`opd_full_divergence` must be [B, S-1], got {list(div.shape)}.")
        tm, sm = base_masks(data, div.shape[1], div.dtype)
        check_shape("opd_full_divergence", div, tuple(tm.shape))
        mask = tm * sm.unsqueeze(-1)
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
            metrics["opd_full_entropy"] = -masked_mean(opd_full_entropy, mask, None, n_t)
        if opd_full_cross_entropy is not None:
            check_shape("opd_full_cross_entropy", opd_full_cross_entropy, tuple(tm.shape))
            metrics["opd_full_cross_entropy"] = masked_mean(opd_full_cross_entropy, mask, None, n_t)
        if opd_full_entropy is not None and opd_full_cross_entropy is not None:
            residual = (opd_full_entropy + opd_full_cross_entropy - div).abs()
            metrics["opd_full_decomposition_error"] = masked_max(residual, mask)
        return loss, detach_metrics(metrics)
