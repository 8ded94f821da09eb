"""PPO value-function loss (docs/behaviour-reference.md §4.6)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_mcore_rl.losses.config import MseValueLossConfig, load_config
from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.utils import (
    get_tensor,
    masked_max,
    masked_mean,
    masked_min,
)

_TOKEN_METRICS = (
    "loss",
    "vf_clipfrac",
    "returns_mean",
    "values_mean",
    "returns_sq_mean",
    "residual_sq_mean",
)


class MseValueLossFn:
    """`0.5 * scale * mean_t (v - R)^2` over global valid tokens, with PPO value clipping, of
    predicted values `logits [B, S]` or `[B, S, 1]` and `data`'s `returns`/old `values [B, S]`.

    Args:
        cfg: A `MseValueLossConfig` or a mapping with its keys.
    """

    # values_min/max are MIN/MAX metrics, ±inf for an empty microbatch: the reference reports 0,
    # which corrupts a min/max over microbatches.

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGIT

    def __init__(self, cfg: MseValueLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = load_config(MseValueLossConfig, cfg)
        self.metric_normalizations = dict.fromkeys(_TOKEN_METRICS, MetricNormalizer.TOKENS)
        self.metric_normalizations.update(
            values_min=MetricNormalizer.MIN,
            values_max=MetricNormalizer.MAX,
            num_valid_samples=MetricNormalizer.NONE,
        )

    @property
    def input_keys(self) -> tuple[str, ...]:
        """`token_mask`, `returns` and, when clipping, the old `values`."""
        return (
            ("token_mask", "returns", "values") if self.cfg.cliprange else ("token_mask", "returns")
        )

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float,
        *,
        logits: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)`; `global_valid_toks` is the unshifted token count."""
        values = logits.squeeze(-1) if logits.ndim == 3 and logits.shape[-1] == 1 else logits
        if values.ndim != 2:
            raise ValueError(f"`logits` must be [B, S] or [B, S, 1], got {list(logits.shape)}.")
        shape = tuple(values.shape)
        sample_mask = get_tensor(data, "sample_mask", (shape[0],)).to(values.dtype)
        # *unshifted*: the value prep already right-shifted the values, so v[:, t] scores the
        # state before token t
        mask = get_tensor(data, "token_mask", shape).to(values.dtype) * sample_mask.unsqueeze(-1)
        returns = get_tensor(data, "returns", shape).to(values.dtype)
        n_t, eps = global_valid_toks, self.cfg.cliprange
        unclipped = (values - returns).square()
        if eps:
            # v_c = clamp(v, v_old - eps, v_old + eps); per token max((v - R)^2, (v_c - R)^2);
            # vf_clipfrac: where the clipped term is strictly larger
            old = get_tensor(data, "values", shape).to(values.dtype)
            clipped = (values.clamp(old - eps, old + eps) - returns).square()
            per_token = unclipped.maximum(clipped)
            clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask, None, n_t)
        else:
            per_token = unclipped
            clipfrac = masked_mean(unclipped.new_zeros(shape), mask, None, n_t)
        loss = 0.5 * self.cfg.scale * masked_mean(per_token, mask, None, n_t)
        v = values.detach()
        metrics = {
            "loss": loss,
            "vf_clipfrac": clipfrac,
            "returns_mean": masked_mean(returns, mask, None, n_t),
            "values_mean": masked_mean(v, mask, None, n_t),
            "returns_sq_mean": masked_mean(returns.square(), mask, None, n_t),
            "residual_sq_mean": masked_mean((returns - v).square(), mask, None, n_t),
            "values_min": masked_min(v, mask),
            "values_max": masked_max(v, mask),
            "num_valid_samples": sample_mask.sum(),
        }
        return loss, detach_metrics(metrics)
