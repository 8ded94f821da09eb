"""Clipped policy-gradient loss: PPO, GRPO, Dr.GRPO, DAPO, GSPO, CISPO, REINFORCE."""

# docs/behaviour-reference.md §4.2. Notation, all [B, S-1] after the next-token shift: c current
# logprobs (the loss input), p = prev_logprobs[:, 1:] (the policy that computed the advantages),
# g = generation_logprobs[:, 1:] (the sampler), ref = reference_policy_logprobs[:, 1:],
# A = advantages[:, 1:], tm = token_mask[:, 1:], sm = sample_mask [B], m = tm * sm,
# N_t/N_s the global valid token/sequence counts.

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_mcore_rl.losses.config import ClippedPGLossConfig, load_config
from lightning_mcore_rl.losses.interfaces import (
    LossInputType,
    LossType,
    MetricNormalizer,
    detach_metrics,
)
from lightning_mcore_rl.losses.utils import (
    KLType,
    LossAggregation,
    aggregate,
    base_masks,
    calculate_kl,
    check_finite_advantages,
    check_shape,
    get_tensor,
    masked_max,
    masked_mean,
    masked_min,
    reference_kl_term,
)

_TOKEN_DIAGNOSTICS = (
    "probs_ratio",
    "probs_ratio_clamped",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "approx_entropy",
    "positive_nll_loss",
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "dual_clip_fraction",
)


class _Inputs(NamedTuple):
    curr: Tensor
    curr_unfiltered: Tensor
    prev: Tensor
    gen: Tensor
    ref: Tensor | None
    adv: Tensor
    token_mask: Tensor
    sample_mask: Tensor
    mask: Tensor


def _diagnostics(inp: _Inputs, kl_type: KLType, n_toks: Tensor | float) -> dict[str, Tensor]:
    """Train/inference mismatch diagnostics of `p` and `g`, token-normalised 0-dim metrics."""
    # docs/behaviour-reference.md §4.2 step 1
    p, g, m = inp.prev.detach(), inp.gen, inp.mask
    # Jensen-Shannon against the mixture log((P + G) / 2), each half a k3 estimate
    log_mix = torch.logaddexp(p, g) - torch.log(torch.tensor(2.0, dtype=p.dtype))
    js = 0.5 * (torch.exp(p - log_mix) - (p - log_mix) - 1) + 0.5 * (
        torch.exp(g - log_mix) - (g - log_mix) - 1
    )
    no_clamp: dict[str, Any] = {"input_clamp_value": None, "output_clamp_value": None}
    gen_kl = calculate_kl(g, p, kl_type, **no_clamp)
    policy_kl = calculate_kl(p, g, kl_type, **no_clamp)
    return {
        "token_mult_prob_error": masked_mean(torch.exp((g - p).abs() * m), m, None, n_toks),
        "gen_kl_error": masked_mean(gen_kl, m, None, n_toks),
        "policy_kl_error": masked_mean(policy_kl, m, None, n_toks),
        "js_divergence_error": masked_mean(js, m, None, n_toks),
    }


class ClippedPGLossFn:
    """Clipped policy-gradient loss with every NeMo RL option, clip fractions, an entropy bonus
    and Dr.GRPO aggregation, from `next_token_logprobs [B, S-1]` and `data`'s `[B, S]` tensors
    (`input_keys`), `sample_mask [B]`, `rewards [B]` (VAPO).

    Args:
        cfg: A `ClippedPGLossConfig` or a mapping with its keys.
        use_fused_linear_logprobs: Read by `prepare_loss_input` (the model returns logprobs).
    """

    # loss = aggregate(w * L) + beta * aggregate(KL) + mu * NLL_pos - entropy_coef * aggregate(H),
    # each term normalised by global counts so per-microbatch losses sum to the global loss.
    # Extrema are MIN/MAX metrics, and missing inputs or NaN advantages raise (the reference
    # does neither).

    input_type = LossInputType.LOGPROB

    def __init__(
        self,
        cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None,
        use_fused_linear_logprobs: bool = False,
    ) -> None:
        self.cfg = load_config(ClippedPGLossConfig, cfg)
        self.use_fused_linear_logprobs = use_fused_linear_logprobs
        self.reference_policy_kl_penalty = (
            0.0 if self.cfg.use_kl_in_reward else self.cfg.reference_policy_kl_penalty
        )
        self.aggregation: LossAggregation = self.cfg.aggregation
        token_level = self.aggregation == "token_mean"
        self.loss_type = LossType.TOKEN_LEVEL if token_level else LossType.SEQUENCE_LEVEL
        self.metric_normalizations = self._normalizations()

    @property
    def token_local_gradient(self) -> bool:
        """Whether each token's gradient reads that token's logprob only (see `LossFunction`)."""
        # true of every term except GSPO's sequence-level ratio, a mean over the sequence
        return not self.cfg.sequence_level_importance_ratios

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The `data` keys this configuration reads."""
        cfg = self.cfg
        keys = ["token_mask", "advantages", "generation_logprobs"]
        if not cfg.force_on_policy_ratio:
            keys.append("prev_logprobs")
        if self.reference_policy_kl_penalty != 0:
            keys.append("reference_policy_logprobs")
        if cfg.positive_example_nll_weight > 0:
            keys.append("rewards")
        return tuple(keys)

    def _normalizations(self) -> dict[str, MetricNormalizer]:
        cfg = self.cfg
        grad = (
            MetricNormalizer.TOKENS
            if self.loss_type is LossType.TOKEN_LEVEL
            else MetricNormalizer.SEQUENCES
        )
        norms = {"loss": grad, "kl_penalty": grad, "num_valid_samples": MetricNormalizer.NONE}
        norms.update(dict.fromkeys(_TOKEN_DIAGNOSTICS, MetricNormalizer.TOKENS))
        for key in ("probs_ratio_min", "probs_ratio_clamped_min"):
            norms[key] = MetricNormalizer.MIN
        for key in ("probs_ratio_max", "probs_ratio_clamped_max"):
            norms[key] = MetricNormalizer.MAX
        norms["sampling_importance_ratio"] = (
            MetricNormalizer.SEQUENCES
            if cfg.sequence_level_importance_ratios
            else MetricNormalizer.TOKENS
        )
        if cfg.truncated_importance_sampling_type is not None:
            norms["is_oob_ratio"] = (
                MetricNormalizer.SEQUENCES
                if cfg.truncated_importance_sampling_type == "seq-mask-tis"
                else MetricNormalizer.TOKENS
            )
        if cfg.entropy_coef > 0:
            norms["entropy"] = MetricNormalizer.TOKENS
        if cfg.force_on_policy_ratio:
            norms["gen_train_ratio_min"] = MetricNormalizer.MIN
            norms["gen_train_ratio_max"] = MetricNormalizer.MAX
        return norms

    def _read_inputs(self, data: Mapping[str, Any], curr: Tensor) -> _Inputs:
        if curr.ndim != 2:
            raise ValueError(
                f"`next_token_logprobs` must be [B, S-1], got shape {list(curr.shape)}."
            )
        batch, width = curr.shape
        tm, sm = base_masks(data, width, curr.dtype)
        check_shape("next_token_logprobs", curr, (sm.shape[0], width))
        full = (batch, width + 1)
        adv = get_tensor(data, "advantages", full)[:, 1:].to(curr.dtype)
        check_finite_advantages(adv)
        gen = get_tensor(data, "generation_logprobs", full)[:, 1:].to(curr.dtype)
        if self.cfg.force_on_policy_ratio:
            # no stored prev_logprobs: the data is on-policy, p = c without a gradient
            prev = curr.detach()
        else:
            prev = get_tensor(data, "prev_logprobs", full)[:, 1:].to(curr.dtype)
        ref = None
        unfiltered = curr
        if self.reference_policy_kl_penalty != 0:
            ref = get_tensor(data, "reference_policy_logprobs", full)[:, 1:].to(curr.dtype)
            # the KL is to the unfiltered policy when top-k/top-p filtered the sampling
            if "curr_logprobs_unfiltered" in data:
                unfiltered = get_tensor(data, "curr_logprobs_unfiltered", (batch, width))
        return _Inputs(curr, unfiltered, prev, gen, ref, adv, tm, sm, tm * sm.unsqueeze(-1))

    def _ratios(self, inp: _Inputs) -> tuple[Tensor, Tensor]:
        cfg, curr = self.cfg, inp.curr
        if cfg.force_on_policy_ratio:
            ratio = torch.exp(curr - curr.detach())  # value 1, gradient of curr
            return ratio, ratio
        if cfg.disable_ppo_ratio:
            # REINFORCE: -A * c, no ratio and no clip
            return curr, curr
        log_ratio = curr - inp.prev
        if cfg.sequence_level_importance_ratios:
            # GSPO (arXiv:2507.18071 Eq. 7): geometric mean over the sequence's own tokens.
            seq_log_ratio = masked_mean(log_ratio, inp.token_mask, dim=-1)  # [B]
            ratio = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(curr)
        else:
            ratio = torch.exp(log_ratio)
        return ratio, ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

    def _clip_loss(
        self, inp: _Inputs, ratio: Tensor, clamped: Tensor, n_toks: Tensor | float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, adv, m = self.cfg, inp.adv, inp.mask
        if cfg.use_cispo:
            # CISPO: the clipped ratio is a detached weight on c, so a clipped token keeps its
            # gradient
            loss = -adv * clamped.detach() * inp.curr
        else:
            # L_t = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)): PPO (arXiv:1707.06347 Eq. 7)
            # with DAPO's asymmetric clip
            loss = torch.max(-adv * ratio, -adv * clamped)
        dual = torch.zeros_like(m, dtype=torch.bool)
        if cfg.ratio_clip_c is not None:
            # dual clip: where A < 0 also min(L_t, -A c), bounding a huge ratio's loss
            dual_bound = -adv * cfg.ratio_clip_c
            dual = (adv < 0) & (dual_bound < loss)
            loss = torch.where(adv < 0, torch.min(loss, dual_bound), loss)
        r = ratio.detach()
        low = r < 1.0 - cfg.ratio_clip_min
        high = r > 1.0 + cfg.ratio_clip_max
        if not cfg.use_cispo:  # PPO's clip only removes the gradient on the pessimistic side
            low, high = low & (adv < 0), high & (adv > 0)
        if cfg.disable_ppo_ratio or cfg.force_on_policy_ratio:
            # the ratio is 1 or absent: nothing is clipped
            low = high = torch.zeros_like(low)
        fractions = {
            "clip_fraction": masked_mean((low | high).to(m.dtype), m, None, n_toks),
            "clip_fraction_low": masked_mean(low.to(m.dtype), m, None, n_toks),
            "clip_fraction_high": masked_mean(high.to(m.dtype), m, None, n_toks),
            "dual_clip_fraction": masked_mean(dual.to(m.dtype), m, None, n_toks),
        }
        return loss, fractions

    def _importance_weights(
        self, inp: _Inputs, n_seqs: Tensor | float, n_toks: Tensor | float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, m = self.cfg, inp.mask
        diff = inp.prev.detach() - inp.gen
        if cfg.sequence_level_importance_ratios:
            # Sequence IS weight exp(sum_t (p - g)), one per sample: [B, 1]
            # (docs/behaviour-reference.md trap 7).
            seq = torch.where(m != 0, diff, torch.zeros_like(diff)).sum(-1, keepdim=True)
            weights = torch.nan_to_num(torch.exp(seq), nan=0.0, posinf=0.0, neginf=0.0)
        else:
            weights = torch.nan_to_num(torch.exp(diff), nan=0.0, posinf=0.0, neginf=0.0)
        kind, hi = cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio
        lo = cfg.truncated_importance_sampling_ratio_min
        extra: dict[str, Tensor] = {}
        if kind in ("tis", "icepop"):
            assert hi is not None
            lo_bound = 0.0 if lo is None else lo
            oob = (weights > hi) | (weights < lo_bound)  # same shape as weights
            extra["is_oob_ratio"] = masked_mean(oob.expand_as(m).to(m.dtype), m, None, n_toks)
            if kind == "tis":
                weights = weights.clamp(lo_bound, hi)
            else:
                weights = torch.where(oob, torch.zeros_like(weights), weights)
        elif kind == "seq-mask-tis":
            log_is = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
            geo = torch.exp(masked_mean(log_is, inp.token_mask, dim=-1))  # [B]
            assert lo is not None and hi is not None  # ClippedPGLossConfig requires both
            kept = ((geo >= lo) & (geo <= hi)).to(m.dtype)
            extra["is_oob_ratio"] = masked_mean(1.0 - kept, inp.sample_mask, None, n_seqs)
            weights = weights * kept.unsqueeze(-1)
        if cfg.sequence_level_importance_ratios:
            # sum_i w_i sm_i / N_s: the reference broadcasts [B, 1] * [B] to [B, B]
            # (docs/behaviour-reference.md trap 18), neither the mean nor additive over microbatches
            mean_w = masked_mean(weights.squeeze(-1), inp.sample_mask, None, n_seqs)
        else:
            mean_w = masked_mean(weights, m, None, n_toks)
        extra["sampling_importance_ratio"] = mean_w
        return weights.detach(), extra

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        *,
        next_token_logprobs: Tensor,
        entropy: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """0-dim share of the global loss and detached metrics, from `next_token_logprobs` and
        (iff `entropy_coef > 0`) the positive per-token `entropy`, both `[B, S-1]`.

        Raises:
            ValueError: missing keys, shape mismatches, NaN advantages or a missing entropy.
        """
        cfg, n_s, n_t = self.cfg, global_valid_seqs, global_valid_toks
        inp = self._read_inputs(data, next_token_logprobs)
        agg = (inp.token_mask, inp.sample_mask, self.aggregation, n_s, n_t)
        metrics = _diagnostics(inp, cfg.reference_policy_kl_type, n_t)

        kl = torch.zeros((), dtype=inp.curr.dtype)
        if inp.ref is not None:
            kl = reference_kl_term(
                inp.curr_unfiltered,
                inp.ref,
                inp.token_mask,
                inp.sample_mask,
                beta=self.reference_policy_kl_penalty,
                kl_type=cfg.reference_policy_kl_type,
                input_clamp_value=cfg.kl_input_clamp_value,
                output_clamp_value=cfg.kl_output_clamp_value,
                aggregation=self.aggregation,
                global_valid_seqs=n_s,
                global_valid_toks=n_t,
                generation=inp.gen if cfg.use_on_policy_kl_approximation else None,
                aggregation_constant=cfg.loss_aggregation_constant,
            )
            metrics["kl_penalty"] = kl / self.reference_policy_kl_penalty
        else:
            metrics["kl_penalty"] = kl

        ratio, clamped = self._ratios(inp)
        clip_loss, fractions = self._clip_loss(inp, ratio, clamped, n_t)
        weights, is_metrics = self._importance_weights(inp, n_s, n_t)
        if not cfg.use_importance_sampling_correction:
            weights = torch.ones_like(weights)
        actor = aggregate(weights * clip_loss, *agg, cfg.loss_aggregation_constant)

        nll = torch.zeros((), dtype=inp.curr.dtype)
        if cfg.positive_example_nll_weight > 0:
            rewards = get_tensor(data, "rewards", (inp.sample_mask.shape[0],))
            # VAPO's positive-example NLL over N_t: the reference divides by the microbatch's own
            # count of positive tokens, not exact under microbatching (hence a TOKENS metric)
            positive = inp.mask * (rewards > 0).to(inp.mask.dtype).unsqueeze(-1)
            nll = masked_mean(-inp.curr, positive, None, n_t)
        loss = actor + kl + cfg.positive_example_nll_weight * nll

        if cfg.entropy_coef > 0:
            if entropy is None:
                raise ValueError(
                    f"`entropy_coef={cfg.entropy_coef}` needs the `entropy` loss input "
                    "[B, S-1]; compute it in prepare_loss_input."
                )
            check_shape("entropy", entropy, tuple(inp.curr.shape))
            loss = loss - cfg.entropy_coef * aggregate(entropy, *agg, cfg.loss_aggregation_constant)
            metrics["entropy"] = masked_mean(entropy, inp.mask, None, n_t)

        m = inp.mask
        with torch.no_grad():
            # importance-weighted -E_g[c]: the current policy's entropy from sampler tokens
            metrics["approx_entropy"] = -masked_mean(
                torch.exp(inp.curr - inp.gen) * inp.curr, m, None, n_t
            )
        metrics.update(fractions)
        metrics.update(is_metrics)
        if cfg.force_on_policy_ratio:
            # no stored prev_logprobs to compare the sampler with (`mismatch_extrema`): the
            # extremes of exp(p - g) come from this forward, p = c
            gen_ratio = torch.exp(inp.prev - inp.gen)
            metrics["gen_train_ratio_min"] = masked_min(gen_ratio, m)
            metrics["gen_train_ratio_max"] = masked_max(gen_ratio, m)
        metrics.update(
            loss=loss,
            positive_nll_loss=nll,
            probs_ratio=masked_mean(ratio, m, None, n_t),
            probs_ratio_clamped=masked_mean(clamped, m, None, n_t),
            probs_ratio_min=masked_min(ratio, m),
            probs_ratio_max=masked_max(ratio, m),
            probs_ratio_clamped_min=masked_min(clamped, m),
            probs_ratio_clamped_max=masked_max(clamped, m),
            num_valid_samples=inp.sample_mask.sum(),
        )
        return loss, detach_metrics(metrics)
