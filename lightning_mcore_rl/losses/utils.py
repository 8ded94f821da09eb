"""Pure tensor helpers shared by the losses: masked reductions, KL estimators, input checks.

Masked reductions select with ``torch.where`` before summing, so garbage (even ``inf``/``NaN``)
at masked positions never reaches the value, and the gradient there is exactly zero.
"""

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
    """``sum(values * mask, dim)`` that ignores whatever sits at masked (zero) positions.

    Args:
        values: Values, any shape broadcastable with ``mask``.
        mask: 0/1 (or weight) mask.
        dim: Dimension to reduce; ``None`` reduces everything.

    Returns:
        The masked sum (0-dim if ``dim`` is None).
    """
    weighted = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype))
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """``sum(values * mask, dim) / (N + 1e-8)`` (docs/behaviour-reference.md §1).

    ``N = sum(mask, dim)`` unless ``global_normalization_factor`` is given, in which case
    ``N`` is that factor. An all-zero mask gives exactly 0, never NaN.

    Args:
        values: Values, e.g. ``[B, S-1]``.
        mask: Mask broadcastable with ``values``, e.g. ``[B, S-1]``.
        dim: Dimension to reduce; ``None`` reduces everything.
        global_normalization_factor: Denominator to use instead of the local mask sum (the
            global valid-token or valid-sequence count).

    Returns:
        The masked mean; 0-dim if ``dim`` is None, else ``values`` without ``dim``.
    """
    numerator = masked_sum(values, mask, dim)
    denominator: Tensor | float
    if global_normalization_factor is None:
        mask_f = mask.to(values.dtype) if mask.dtype == torch.bool else mask
        denominator = mask_f.sum() if dim is None else mask_f.sum(dim)
    else:
        denominator = global_normalization_factor
    return numerator / (denominator + MASKED_MEAN_EPS)


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Minimum over positions where ``mask`` is nonzero, ``+inf`` if there are none.

    Args:
        values: Values, e.g. ``[B, S-1]``.
        mask: Mask broadcastable with ``values``.

    Returns:
        A detached 0-dim tensor.
    """
    values = values.detach()
    inf = torch.tensor(float("inf"), dtype=values.dtype)
    return torch.where(mask != 0, values, inf).amin()


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Maximum over positions where ``mask`` is nonzero, ``-inf`` if there are none.

    Args:
        values: Values, e.g. ``[B, S-1]``.
        mask: Mask broadcastable with ``values``.

    Returns:
        A detached 0-dim tensor.
    """
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
    """Per-token estimators of KL(pi || pi_ref) from sampled-token logprobs (Schulman 2020).

    With ``r = logprobs_reference - logprobs``: ``k1 = -r``, ``k2 = r^2 / 2``,
    ``k3 = exp(r) - 1 - r``. ``r`` is first clamped to ``±input_clamp_value``; where that clamp
    changed ``r`` the importance weight is detached (its score-function gradient would otherwise
    push on a value the clamp already cut). The estimate is multiplied by the weights and then
    clamped to ``±output_clamp_value``. A clamp of ``None`` disables it.

    Args:
        logprobs: Current-policy logprobs, e.g. ``[B, S-1]``.
        logprobs_reference: Reference-policy logprobs, same shape.
        kl_type: ``"k1"``, ``"k2"`` or ``"k3"``.
        input_clamp_value: Clamp for the log-ratio ``r``.
        output_clamp_value: Clamp for the weighted estimate.
        importance_sampling_weights: Optional weights, same shape.

    Returns:
        The per-token KL estimate, same shape as ``logprobs``.

    Raises:
        ValueError: If ``kl_type`` is unknown.
    """
    if kl_type not in ("k1", "k2", "k3"):
        raise ValueError(f"`kl_type` must be one of 'k1', 'k2', 'k3', got {kl_type!r}.")
    log_ratio = logprobs_reference - logprobs
    weights = importance_sampling_weights
    if input_clamp_value is not None:
        clamped = log_ratio.clamp(-input_clamp_value, input_clamp_value)
        if weights is not None:
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
    """Reduce a per-token loss to this microbatch's share of the global loss.

    With ``m = token_mask * sample_mask``, ``N_t``/``N_s`` the global valid token/sequence counts:

    * ``token_mean``: ``sum(x * m) / N_t``;
    * ``seq_mean_token_mean``: ``sum_i sm_i * mean_t(x_i) / N_s`` (mean over each sequence's
      own valid tokens);
    * ``seq_mean_token_sum``: ``sum_i sm_i * sum_t(x_i * tm_i) / N_s``;
    * ``seq_mean_token_sum_norm``: ``sum_i sm_i * sum_t(x_i * tm_i) / (C * N_s)``, Dr.GRPO's
      constant-normalised form (arXiv:2503.20783, Eq. 3) with ``C = constant``.

    Every mode is a sum over samples of terms that depend on one sample only, divided by a global
    count, so per-microbatch results sum to the whole-batch value.

    Args:
        per_token: Per-token loss ``[B, S-1]``.
        token_mask: ``[B, S-1]`` shifted token mask.
        sample_mask: ``[B]`` sample mask.
        mode: The aggregation mode.
        global_valid_seqs: ``N_s``.
        global_valid_toks: ``N_t``.
        constant: ``C`` for ``seq_mean_token_sum_norm``.

    Returns:
        A 0-dim tensor.
    """
    if mode == "token_mean":
        mask = token_mask * sample_mask.unsqueeze(-1)
        return masked_mean(per_token, mask, global_normalization_factor=global_valid_toks)
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
    """``beta * aggregate(w * KL(curr || ref))`` with the on-policy score-function weight.

    The KL samples come from the sampler, so the estimator is weighted by
    ``w = exp(curr - curr.detach())`` (value 1, gradient of the sampling probability,
    arXiv:2506.09477) or, with ``generation`` given (on-policy KL approximation),
    ``w = exp(curr - generation)``. Non-finite weights become 0. For k3 and ``w = 1`` the
    gradient per token is ``beta * (k3 + 1 - exp(r)) / N_t`` with ``r = ref - curr``.

    Args:
        curr_unfiltered: ``[B, S-1]`` current logprobs without top-k/top-p filtering.
        reference: ``[B, S-1]`` reference-policy logprobs.
        token_mask: ``[B, S-1]`` shifted token mask.
        sample_mask: ``[B]`` sample mask.
        beta: KL coefficient.
        kl_type: KL estimator.
        input_clamp_value: Log-ratio clamp (``None`` disables it).
        output_clamp_value: Per-token KL clamp (``None`` disables it).
        aggregation: How tokens are reduced (see :func:`aggregate`).
        global_valid_seqs: ``N_s``.
        global_valid_toks: ``N_t``.
        generation: ``[B, S-1]`` sampler logprobs for the on-policy KL approximation.
        aggregation_constant: Constant of ``seq_mean_token_sum_norm``.

    Returns:
        A 0-dim tensor.
    """
    source = curr_unfiltered.detach() if generation is None else generation
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
    """Fetch ``data[key]`` and check it is a tensor of the expected shape.

    Args:
        data: The microbatch mapping.
        key: Key to read.
        shape: Expected shape; ``None`` skips the check.

    Returns:
        The tensor.

    Raises:
        ValueError: If the key is missing or the shape differs.
        TypeError: If the value is not a tensor.
    """
    if key not in data:
        raise ValueError(f"The batch is missing the key `{key}` (present: {sorted(data)}).")
    value = data[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"`{key}` must be a torch.Tensor, got {type(value).__name__}.")
    check_shape(key, value, shape)
    return value


def check_shape(name: str, tensor: Tensor, shape: tuple[int, ...] | None) -> None:
    """Raise a ValueError naming ``name`` if ``tensor.shape != shape``.

    Args:
        name: Name of the tensor, for the message.
        tensor: The tensor.
        shape: Expected shape; ``None`` skips the check.

    Raises:
        ValueError: On mismatch.
    """
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {list(shape)}, got {list(tensor.shape)}.")


def check_finite_advantages(advantages: Tensor) -> None:
    """Raise if ``advantages`` holds NaN (a NaN would poison the gradient even where masked).

    Args:
        advantages: ``[B, S-1]`` advantages.

    Raises:
        ValueError: If any entry is NaN.
    """
    if torch.isnan(advantages).any():
        rows = torch.isnan(advantages).any(dim=-1).nonzero().flatten().tolist()
        raise ValueError(
            f"`advantages` contains NaN in sample rows {rows}; fix the advantage estimator "
            "(e.g. a zero reward standard deviation) before the loss."
        )


def base_masks(data: Mapping[str, Any], width: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Read ``token_mask [B, S]`` and ``sample_mask [B]`` and shift the token mask.

    Args:
        data: The microbatch.
        width: ``S - 1``, the width of the loss inputs.
        dtype: Floating dtype of the loss inputs.

    Returns:
        ``(token_mask[:, 1:] [B, S-1], sample_mask [B])`` cast to ``dtype``.
    """
    sample_mask = get_tensor(data, "sample_mask")
    batch = sample_mask.shape[0]
    check_shape("sample_mask", sample_mask, (batch,))
    token_mask = get_tensor(data, "token_mask", (batch, width + 1))
    return token_mask[:, 1:].to(dtype), sample_mask.to(dtype)
