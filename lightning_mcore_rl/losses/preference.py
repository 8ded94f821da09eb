"""Pairwise preference losses (Bradley-Terry reward model, DPO) over interleaved pairs."""

# docs/behaviour-reference.md §4.4. Samples are interleaved [chosen_0, rejected_0, chosen_1, ...];
# a microbatch must hold whole pairs. `global_valid_seqs` counts both halves, so pair means
# divide by N_s / 2 (docs/behaviour-reference.md trap 15).

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.losses.config import DPOLossConfig, load_config
from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.nll import per_sample_nll
from lightning_mcore_rl.losses.utils import (
    base_masks,
    check_shape,
    get_tensor,
    masked_mean,
    masked_sum,
)

_PAIR_METRICS = ("loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean")


def _check_pairs(sample_mask: Tensor) -> None:
    if sample_mask.shape[0] % 2:
        raise ValueError(
            "Preference batches interleave chosen/rejected samples, so the batch size must be "
            f"even; got {sample_mask.shape[0]} samples."
        )


def split_output_tensor(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """`(chosen, rejected)` strided views `[B/2, ...]` of interleaved `[B, ...]` rows.

    Raises:
        ValueError: `tensor` is 0-dim or `B` is odd.
    """
    if tensor.dim() == 0:
        raise ValueError(
            "`tensor` must have a leading sample dimension [B, ...], got a 0-dim tensor."
        )
    _check_pairs(tensor)
    return tensor[::2], tensor[1::2]


def preference_terms(
    rewards: Tensor, sample_mask: Tensor, global_valid_seqs: Tensor | float, beta: float = 1.0
) -> dict[str, Tensor]:
    """Bradley-Terry `-log sigmoid(beta (rho_c - rho_r))` over the global pairs, with 0-dim
    `accuracy` and reward means; `rewards`/`sample_mask` are interleaved `[B]`."""
    chosen, rejected = split_output_tensor(rewards)
    sm_c, sm_r = split_output_tensor(sample_mask)
    # N_s counts chosen and rejected samples: the pair count is half of it
    pairs = global_valid_seqs / 2
    per_pair = -F.logsigmoid(beta * (chosen - rejected))
    return {
        "loss": masked_mean(per_pair, sm_c, None, pairs),
        "accuracy": masked_mean((chosen > rejected).to(rewards.dtype), sm_c, None, pairs),
        "rewards_chosen_mean": masked_mean(chosen, sm_c, None, pairs),
        "rewards_rejected_mean": masked_mean(rejected, sm_r, None, pairs),
    }


class PreferenceLossFn:
    """Bradley-Terry reward-model loss (beta = 1) on interleaved scores `logits [B]` or `[B, 1]`."""

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGIT
    input_keys = ()
    split_output_tensor = staticmethod(split_output_tensor)
    """``(chosen, rejected)`` rows of an interleaved ``[B, ...]`` tensor (the reference's method)."""

    def __init__(self) -> None:
        self.metric_normalizations = dict.fromkeys(_PAIR_METRICS, MetricNormalizer.SEQUENCES)
        self.metric_normalizations["num_valid_samples"] = MetricNormalizer.NONE

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float | None,
        *,
        logits: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)` of `logits [B]` or `[B, 1]` (`global_valid_toks` unused)."""
        sample_mask = get_tensor(data, "sample_mask")
        rewards = logits.squeeze(-1) if logits.ndim == 2 else logits
        check_shape("logits", rewards, tuple(sample_mask.shape))
        metrics = preference_terms(rewards, sample_mask.to(rewards.dtype), global_valid_seqs)
        metrics["num_valid_samples"] = sample_mask.sum() / 2
        return metrics["loss"], detach_metrics(metrics)


class DPOLossFn:
    """DPO (arXiv:2305.18290 Eq. 7) plus an optional SFT term, from `next_token_logprobs [B, S-1]`
    and `data`'s `token_mask`, rolled `reference_policy_logprobs` (`[B, S]`), `sample_mask [B]`.

    Args:
        cfg: A `DPOLossConfig` or a mapping with its keys.
        use_fused_linear_logprobs: Read by `prepare_loss_input`.
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB
    input_keys = ("token_mask", "reference_policy_logprobs")
    split_output_tensor = staticmethod(split_output_tensor)
    """As :attr:`PreferenceLossFn.split_output_tensor` (the reference's DPO inherits it)."""

    def __init__(
        self,
        cfg: DPOLossConfig | Mapping[str, Any] | None = None,
        use_fused_linear_logprobs: bool = False,
    ) -> None:
        self.cfg = load_config(DPOLossConfig, cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.metric_normalizations = dict.fromkeys(
            (*_PAIR_METRICS, "sft_loss", "preference_loss"), MetricNormalizer.SEQUENCES
        )
        self.metric_normalizations["num_valid_samples"] = MetricNormalizer.NONE

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float | None,
        *,
        next_token_logprobs: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`(loss, metrics)` of `next_token_logprobs [B, S-1]` (`global_valid_toks` unused)."""
        cfg, c = self.cfg, next_token_logprobs
        if c.ndim != 2:
            raise ValueError(f"`next_token_logprobs` must be [B, S-1], got {list(c.shape)}.")
        tm, sm = base_masks(data, c.shape[1], c.dtype)
        _check_pairs(sm)
        check_shape("next_token_logprobs", c, tuple(tm.shape))
        # stored rolled left by one ([:, t] = log p_ref(x_{t+1})): `[:, :-1]` aligns with c
        full = (c.shape[0], c.shape[1] + 1)
        ref = get_tensor(data, "reference_policy_logprobs", full)[:, :-1].to(c.dtype)
        # implicit reward rho_i = sum_t (c - ref)_t tm_t (over max(sum_t tm_t, 1) when averaged)
        rewards = masked_sum(c - ref, tm, dim=-1)  # [B]
        if cfg.preference_average_log_probs:
            rewards = rewards / tm.sum(-1).clamp(min=1)
        metrics = preference_terms(rewards, sm, global_valid_seqs, cfg.reference_policy_kl_penalty)
        preference = metrics["loss"]
        sft = torch.zeros((), dtype=c.dtype)
        # sft: the per-sample NLL of the chosen responses averaged over the N_s / 2 pairs
        if cfg.sft_loss_weight > 0:
            nll = per_sample_nll(c, tm * sm.unsqueeze(-1), cfg.sft_average_log_probs)  # [B]
            sft = masked_mean(split_output_tensor(nll)[0], sm[::2], None, global_valid_seqs / 2)
        loss = cfg.sft_loss_weight * sft + cfg.preference_loss_weight * preference
        metrics.update(
            loss=loss, sft_loss=sft, preference_loss=preference, num_valid_samples=sm.sum() / 2
        )
        return loss, detach_metrics(metrics)
