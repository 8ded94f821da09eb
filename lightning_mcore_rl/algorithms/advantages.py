"""Advantages: GRPO group-relative (Shao et al. 2024, DeepSeekMath, §4.1.2) and its
leave-one-out (RLOO) variant, REINFORCE++, and GAE over a value model's estimates.

Samples are laid out group-major: the ``G`` completions of prompt ``i`` are rows ``i*G .. i*G+G-1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantage of each completion relative to the other completions of its prompt.

    ``A_i = (r_i - b_i) / (std_g + eps)`` with ``b_i`` the group mean (or, with ``leave_one_out``,
    the mean of the OTHER ``G-1`` rewards, an unbiased baseline) and ``std_g`` the group's unbiased
    standard deviation (only with ``normalize_std``; Dr.GRPO drops it). A group whose rewards are
    all equal gets advantage 0 (no learning signal), never NaN.

    Args:
        rewards: ``[B*G]`` scalar reward per completion, group-major.
        group_size: ``G``, completions per prompt (>= 2 with ``leave_one_out`` or ``normalize_std``).
        normalize_std: divide by the group's standard deviation.
        leave_one_out: baseline = mean of the other completions of the group.
        eps: added to the standard deviation.

    Returns:
        ``[B*G]`` advantages (same dtype as ``rewards``).
    """
    if rewards.ndim != 1:
        raise ValueError(f"`rewards` must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"`group_size` ({group_size}) must be >= 1 and divide the number of rewards "
            f"({rewards.numel()})"
        )
    if (normalize_std or leave_one_out) and group_size < 2:
        raise ValueError("`group_size` must be >= 2 for a baseline/std over the group")
    if not torch.isfinite(rewards).all():
        raise ValueError("`rewards` contains NaN or inf")
    grouped = rewards.view(-1, group_size)  # [B, G]
    total = grouped.sum(dim=1, keepdim=True)
    baseline = (total - grouped) / (group_size - 1) if leave_one_out else total / group_size
    advantages = grouped - baseline
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True)
        advantages = torch.where(std > 0, advantages / (std + eps), torch.zeros_like(advantages))
    return advantages.reshape(-1)


def nonfinite_reward_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which completions belong to a group holding a NaN/inf reward (the estimators above
    reject such rewards; a recipe masks them and gives the group NaN advantages, which the
    training step's non-finite policy skips on every rank).

    Args:
        rewards: ``[B*G]`` rewards, group-major.
        group_size: ``G``.

    Returns:
        ``[B*G]`` bool, True for every completion of such a group.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"`rewards` must be 1-D [B*G] with G={group_size} dividing it, got shape "
            f"{tuple(rewards.shape)}"
        )
    bad = ~torch.isfinite(rewards).view(-1, group_size).all(dim=1)  # [B]
    return bad.repeat_interleave(group_size)


def token_level_advantages(advantages: Tensor, token_mask: Tensor) -> Tensor:
    """Broadcast per-sample advantages ``[B]`` onto tokens: ``[B, S]``, zero where masked."""
    if advantages.shape != token_mask.shape[:1]:
        raise ValueError(
            f"`advantages` {tuple(advantages.shape)} must be [B] for token_mask "
            f"{tuple(token_mask.shape)}"
        )
    return advantages[:, None] * token_mask.to(advantages.dtype)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    unbiased: bool = False,
    eps: float = 1e-8,
    group: Any = None,
) -> Tensor:
    """``(x - mean) / sqrt(max(var, eps))`` over the entries where ``mask`` is 1, masked entries
    left as computed (the loss masks them).

    The mean and variance are those of the whole global batch: with ``group`` (the data-parallel
    process group) the sums are all-reduced over it, so every rank whitens with the same
    statistics whatever the data-parallel size.

    Args:
        values: ``[B, S]``.
        mask: ``[B, S]`` 1 at valid tokens.
        unbiased: divide the squared deviations by ``N - 1`` (NeMo RL's GAE whitening) instead
            of ``N`` (its REINFORCE++ normalisation).
        eps: lower bound of the variance.
        group: process group to reduce the statistics over (``None``: this rank's entries).

    Returns:
        ``[B, S]`` whitened values.
    """
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), mask.sum()])
    _all_reduce(stats, group)
    count = stats[1].clamp(min=1.0)
    mean = stats[0] / count
    squared = ((values - mean).square() * mask).sum().reshape(1)
    _all_reduce(squared, group)
    var = squared[0] / ((count - 1.0).clamp(min=1.0) if unbiased else count)
    return (values - mean) * var.clamp(min=eps).rsqrt()


def _all_reduce(tensor: Tensor, group: Any) -> None:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(tensor, group=group)


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    group_size: int,
    token_mask: Tensor,
    *,
    minus_baseline: bool = True,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    group: Any = None,
) -> Tensor:
    """REINFORCE++ token advantages (arXiv:2501.03262; NeMo RL's ``reinforce_plus_plus``).

    ``a = r - mean_group(r)`` (``minus_baseline``; else ``a = r``) broadcast onto the tokens,
    minus ``kl_coef * kl`` per token (the KL folded into the reward, ``use_kl_in_reward``), then
    whitened over the valid tokens of the global batch (population variance, see
    :func:`masked_whiten`); zero where ``token_mask`` is 0.

    Args:
        rewards: ``[B*G]`` scalar rewards, group-major.
        group_size: ``G``.
        token_mask: ``[B*G, S]`` 1 at completion tokens.
        minus_baseline: subtract the group mean.
        kl: ``[B*G, S]`` per-token KL estimate of the sampling policy against the reference.
        kl_coef: its weight (``reference_policy_kl_penalty``).
        group: data-parallel process group of the global whitening.

    Returns:
        ``[B*G, S]`` advantages.
    """
    baseline = grpo_advantages(rewards, group_size, normalize_std=False)  # checks the rewards
    per_sample = baseline if minus_baseline else rewards
    mask = token_mask.to(rewards.dtype)
    advantages = per_sample[:, None].expand_as(mask)
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(
                f"`kl` {tuple(kl.shape)} must match token_mask {tuple(mask.shape)} ([B*G, S])."
            )
        advantages = advantages - kl_coef * kl.to(rewards.dtype)
    return masked_whiten(advantages, mask, group=group) * mask


def terminal_token_rewards(
    rewards: Tensor, token_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards of a sequence-level reward: ``rewards`` on each row's last valid token,
    ``-kl_coef * kl`` on every valid token (``use_kl_in_reward``), 0 elsewhere (NeMo RL's GAE
    token rewards).

    Args:
        rewards: ``[B]``.
        token_mask: ``[B, S]`` 1 at completion tokens.
        kl: optional ``[B, S]`` per-token KL estimate.
        kl_coef: its weight.

    Returns:
        ``[B, S]`` token rewards.
    """
    if rewards.shape != token_mask.shape[:1]:
        raise ValueError(
            f"`rewards` {tuple(rewards.shape)} must be [B] for token_mask {tuple(token_mask.shape)}"
        )
    mask = token_mask.to(rewards.dtype)
    token_rewards = torch.zeros_like(mask)
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl.to(rewards.dtype)
    width = mask.shape[1]
    last = width - 1 - mask.flip(1).argmax(dim=1)  # [B]
    has_tokens = mask.sum(dim=1) > 0
    terminal = torch.zeros_like(mask).scatter(1, last[:, None], rewards[:, None])
    return (token_rewards + terminal * has_tokens[:, None].to(mask.dtype)) * mask


def gae_advantages(
    token_rewards: Tensor, values: Tensor, token_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438).

    Over the valid tokens of each row, from the last one back:
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where
    ``V_next``/``A_next`` belong to the next VALID token (0 after the last one: the episode
    ends). Masked positions carry the accumulators over unchanged (NeMo RL's carry-forward
    masking), so gaps in the mask add no TD error. ``returns = A + V`` are the value targets.

    Args:
        token_rewards: ``[B, S]`` per-token rewards (:func:`terminal_token_rewards`).
        values: ``[B, S]`` value of the state before each token (``V(s_t)`` at token ``t``).
        token_mask: ``[B, S]`` 1 at the tokens that are actions.
        gamma: discount.
        lam: GAE lambda (0: one-step TD, 1: Monte-Carlo returns minus ``V``).

    Returns:
        ``(advantages, returns)``, both ``[B, S]``, zero where ``token_mask`` is 0.
    """
    if not (token_rewards.shape == values.shape == token_mask.shape) or values.ndim != 2:
        raise ValueError(
            f"`token_rewards` {tuple(token_rewards.shape)}, `values` {tuple(values.shape)} and "
            f"`token_mask` {tuple(token_mask.shape)} must be the same [B, S] shape."
        )
    mask = token_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t] * m + (1 - m) * next_value
        next_advantage = advantage * m + (1 - m) * next_advantage
        columns.append(advantage * m)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, (advantages + values) * mask
