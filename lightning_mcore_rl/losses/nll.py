"""Negative log-likelihood (SFT) loss (docs/behaviour-reference.md §4.3)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.utils import base_masks, check_shape, masked_mean, masked_sum


def per_sample_nll(logprobs: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """`[B]` per-sample NLL `-sum_t c_t m_t` of `logprobs`/`mask [B, S-1]`, with `average`
    divided by `max(sum_t m_t, 1)` (a fully masked sample gives 0, not NaN)."""
    loss = -masked_sum(logprobs, mask, dim=-1)
    if average:
        loss = loss / mask.sum(-1).clamp(min=1)
    return loss


class NLLLossFn:
    """Token-mean NLL `-sum(c * m) / N_t` of `next_token_logprobs [B, S-1]`.

    Args:
        use_fused_linear_logprobs: Read by `prepare_loss_input` (the model returns logprobs).
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB
    input_keys = ("token_mask",)
    token_local_gradient = True
    """``-m_t / N_t`` at every token: the fused head can compute its gradients in the forward
    (:class:`~lightning_mcore_rl.losses.LossFunction`)."""

    def __init__(self, use_fused_linear_logprobs: bool = False) -> None:
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.metric_normalizations = {
            "loss": MetricNormalizer.TOKENS,
            "num_unmasked_tokens": MetricNormalizer.NONE,
            "num_valid_samples": MetricNormalizer.NONE,
        }

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float,
        *,
        next_token_logprobs: Tensor,
        dpo_loss: bool = False,
        dpo_average_log_probs: bool = False,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)`: a 0-dim loss, or with `dpo_loss` the per-sample NLL `[B]`
        (averaged over each sample's tokens with `dpo_average_log_probs`)."""
        if next_token_logprobs.ndim != 2:
            raise ValueError(
                "`next_token_logprobs` must be [B, S-1], got shape "
                f"{list(next_token_logprobs.shape)}."
            )
        tm, sm = base_masks(data, next_token_logprobs.shape[1], next_token_logprobs.dtype)
        check_shape("next_token_logprobs", next_token_logprobs, tuple(tm.shape))
        mask = tm * sm.unsqueeze(-1)
        if dpo_loss:
            # DPO's SFT term: the `loss` metric is then that detached [B] tensor
            loss = per_sample_nll(next_token_logprobs, mask, dpo_average_log_probs)
        else:
            loss = -masked_mean(next_token_logprobs, mask, None, global_valid_toks)
        metrics = {"loss": loss, "num_unmasked_tokens": mask.sum(), "num_valid_samples": sm.sum()}
        return loss, detach_metrics(metrics)
