"""Pure tensor helpers shared by the losses: masked reductions, KL estimators, input checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

KLType = Literal["k1", "k2", "k3"]
LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
MASKED_MEAN_EPS = 1e-8


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """`sum(values * mask, dim)` (0-dim for `dim=None`), blind to what sits where `mask` is 0."""
    # Select with `where` before summing: garbage (even inf/NaN) at masked positions never
    # reaches the value, and the gradient there is exactly zero (`values * 0` would give NaN).
    weighted = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype))
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """`masked_sum / (N + 1e-8)`, `N = sum(mask, dim)` or `global_normalization_factor`.

    `values` e.g. `[B, S-1]`, `mask` broadcastable; 0-dim for `dim=None`, else without `dim`.
    """
    # docs/behaviour-reference.md §1. The eps makes an all-zero mask give exactly 0, never NaN;
    # the global factor (valid tokens or sequences of the whole batch) lets microbatches sum.
    numerator = masked_sum(values, mask, dim)
    denominator: Tensor | float
    if global_normalization_factor is None:
        mask_f = mask.to(values.dtype) if mask.dtype == torch.bool else mask
        denominator = mask_f.sum() if dim is None else mask_f.sum(dim)
    else:
        denominator = global_normalization_factor
    return numerator / (denominator + MASKED_MEAN_EPS)


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Detached 0-dim minimum of `values` where `mask` is nonzero, `+inf` if nowhere."""
    values = values.detach()
    inf = torch.tensor(float("inf"), dtype=values.dtype)
    return torch.where(mask != 0, values, inf).amin()


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Detached 0-dim maximum of `values` where `mask` is nonzero, `-inf` if nowhere."""
    values = values.detach()
    ninf = torch.tensor(float("-inf"), dtype=values.dtype)
    return torch.where(mask != 0, values, ninf).amax()


def calculate_kl(
    logprobs: Tensor,
    logprobs_reference: Tensor,
    kl_type: KLType = "k3",
    input_clamp_value: float | None = 20,
    output_clamp_value: float | None = 10,
    importance_sampling_weights: Tensor | None = None,
) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate (Schulman 2020) from `[B, S-1]` sampled-token logprobs.

    With `r = logprobs_reference - logprobs`: `k1 = -r`, `k2 = r^2 / 2`, `k3 = exp(r) - 1 - r`;
    `r` clamped to `±input_clamp_value`, the weighted estimate to `±output_clamp_value` (`None`:
    no clamp). Raises `ValueError` for an unknown `kl_type`.
    """
    if kl_type not in ("k1", "k2", "k3"):
        raise ValueError(f"`kl_type` must be one of 'k1', 'k2', 'k3', got {kl_type!r}.")
    log_ratio = logprobs_reference - logprobs
    weights = importance_sampling_weights
    if input_clamp_value is not None:
        clamped = log_ratio.clamp(-input_clamp_value, input_clamp_value)
        if weights is not None:
            # where the clamp cut r, the weight's score-function gradient would push on a value
            # the clamp already cut: detach it there
            weights = torch.where(clamped != log_ratio, weights.detach(), weights)
        log_ratio = clamped
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(log_ratio) - 1 - log_ratio
    if weights is not None:
        kl = weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def aggregate(
    per_token: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    mode: LossAggregation,
    global_valid_seqs: Tensor | float,
    global_valid_toks: Tensor | float,
    constant: float | None = None,
) -> Tensor:
    """0-dim share of this microbatch in the global loss, from `per_token`/`token_mask [B, S-1]`
    and `sample_mask [B]`; `N_s`/`N_t` are the global valid sequence/token counts."""
    # Every mode is a sum over samples of terms that depend on one sample only, divided by a
    # global count, so per-microbatch results sum to the whole-batch value.
    # token_mean: sum(x * tm * sm) / N_t
    if mode == "token_mean":
        mask = token_mask * sample_mask.unsqueeze(-1)
        return masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
    # seq_mean_*: sum_i sm_i * f(x_i) / N_s, f the mean or the sum over the sequence's own
    # valid tokens; _norm also divides by C, Dr.GRPO's constant (arXiv:2503.20783, Eq. 3)
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, token_mask, dim=-1)  # [B]
    else:
        per_seq = masked_sum(per_token, token_mask, dim=-1)  # [B]
        if mode == "seq_mean_token_sum_norm":
            assert constant is not None, "validated by the loss config"
            per_seq = per_seq / constant
    return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)


def reference_kl_term(
    curr_unfiltered: Tensor,
    reference: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    *,
    beta: float,
    kl_type: KLType,
    input_clamp_value: float | None,
    output_clamp_value: float | None,
    aggregation: LossAggregation,
    global_valid_seqs: Tensor | float,
    global_valid_toks: Tensor | float,
    generation: Tensor | None = None,
    aggregation_constant: float | None = None,
) -> Tensor:
    """0-dim `beta * aggregate(w * KL(curr || ref))`; logprobs `[B, S-1]`, `sample_mask [B]`.

    `curr_unfiltered` are the current logprobs without top-k/top-p filtering; `generation` the
    sampler's, for the on-policy KL approximation.
    """
    # The KL samples come from the sampler, so the estimator is weighted by the score-function
    # weight w = exp(curr - curr.detach()) (value 1, gradient of the sampling probability,
    # arXiv:2506.09477), or w = exp(curr - generation) with `generation`. For k3 and w = 1 the
    # per-token gradient is beta * (k3 + 1 - exp(r)) / N_t with r = ref - curr.
    source = curr_unfiltered.detach() if generation is None else generation
    # a non-finite weight (a -inf logprob) contributes nothing rather than NaN
    weights = torch.nan_to_num(torch.exp(curr_unfiltered - source), nan=0.0, posinf=0.0)
    kl = calculate_kl(
        curr_unfiltered,
        reference,
        kl_type=kl_type,
        input_clamp_value=input_clamp_value,
        output_clamp_value=output_clamp_value,
        importance_sampling_weights=weights,
    )
    return beta * aggregate(
        kl,
        token_mask,
        sample_mask,
        aggregation,
        global_valid_seqs,
        global_valid_toks,
        aggregation_constant,
    )


def get_tensor(data: Mapping[str, Any], key: str, shape: tuple[int, ...] | None = None) -> Tensor:
    """`data[key]`, checked to be a tensor of `shape` (`None`: any).

    Raises:
        ValueError: the key is missing or the shape differs.
        TypeError: the value is not a tensor.
    """
    if key not in data:
        raise ValueError(f"The batch is missing the key `{key}` (present: {sorted(data)}).")
    value = data[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"`{key}` must be a torch.Tensor, got {type(value).__name__}.")
    check_shape(key, value, shape)
    return value


def check_shape(name: str, tensor: Tensor, shape: tuple[int, ...] | None) -> None:
    """Raise a `ValueError` naming `name` if `tensor.shape != shape` (`None`: no check)."""
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {list(shape)}, got {list(tensor.shape)}.")


def check_finite_advantages(advantages: Tensor) -> None:
    """Raise a `ValueError` naming the rows if `advantages [B, S-1]` holds NaN."""
    # A NaN poisons the gradient even where masked: `where` blocks the value, but the backward
    # of a product with the advantage still computes NaN * 0 = NaN there.
    if torch.isnan(advantages).any():
        rows = torch.isnan(advantages).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(
            f"`advantages` contains NaN in sample rows {rows}; fix the advantage estimator "
            "(e.g. a zero reward standard deviation) before the loss."
        )


def base_masks(data: Mapping[str, Any], width: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`(token_mask[:, 1:] [B, S-1], sample_mask [B])` of the microbatch, cast to `dtype`.

    `width` is `S - 1`, the width of the loss inputs."""
    # Shifted: position t of the loss inputs predicts token t + 1, whose mask entry decides.
    sample_mask = get_tensor(data, "sample_mask")
    batch = sample_mask.shape[0]
    check_shape("sample_mask", sample_mask, (batch,))
    token_mask = get_tensor(data, "token_mask", (batch, width + 1))
    return token_mask[:, 1:].to(dtype), sample_mask.to(dtype)
