"""Advantages: GRPO (and its RLOO variant), REINFORCE++ and GAE; samples are group-major."""

# Group-major: the `G` completions of prompt `i` are rows `i*G .. i*G+G-1`.

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
    """GRPO advantages `(r - baseline) / (std + eps)` per group: `[B*G]` -> `[B*G]`.

    Raises `ValueError` for rewards not 1-D or not finite, or `G` not dividing them."""
    # Shao et al. 2024 (DeepSeekMath) §4.1.2; `normalize_std=False` is Dr.GRPO.
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
    # leave_one_out (RLOO): the mean of the OTHER G-1 rewards, an unbiased baseline
    baseline = (total - grouped) / (group_size - 1) if leave_one_out else total / group_size
    advantages = grouped - baseline
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True)  # unbiased
        # a group of equal rewards carries no signal: advantage 0, never NaN
        advantages = torch.where(std > 0, advantages / (std + eps), torch.zeros_like(advantages))
    return advantages.reshape(-1)


def nonfinite_reward_groups(rewards: Tensor, group_size: int) -> Tensor:
    """`[B*G]` bool: True for every completion of a group holding a NaN/inf reward."""
    # The estimators above reject such rewards; a recipe masks them and gives the group NaN
    # advantages, which the training step's non-finite policy skips on every rank.
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"`rewards` must be 1-D [B*G] with G={group_size} dividing it, got shape "
            f"{tuple(rewards.shape)}"
        )
    bad = ~torch.isfinite(rewards).view(-1, group_size).all(dim=1)  # [B]
    return bad.repeat_interleave(group_size)


def token_level_advantages(advantages: Tensor, token_mask: Tensor) -> Tensor:
    """Broadcast per-sample advantages `[B]` onto tokens: `[B, S]`, zero where masked."""
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
    """`(x - mean) / sqrt(max(var, eps))` of `values [B, S]` over `mask [B, S]`, reduced
    over `group` (`None`: this rank's entries)."""
    # `unbiased`: variance over N - 1 (NeMo RL's GAE whitening), else N (its REINFORCE++).
    # Masked entries are left as computed: the loss masks them.
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), mask.sum()])
    # statistics of the whole global batch: every data-parallel rank whitens the same way
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
    """REINFORCE++ (arXiv:2501.03262): `rewards [B*G]`, `token_mask`/`kl [B*G, S]` -> `[B*G, S]`.

    `kl_coef` is NeMo RL's `reference_policy_kl_penalty`; `group` the data-parallel group."""
    # NeMo RL's `reinforce_plus_plus`: a = r - mean_group(r) (or r), broadcast onto the tokens.
    baseline = grpo_advantages(rewards, group_size, normalize_std=False)  # checks the rewards
    per_sample = baseline if minus_baseline else rewards
    mask = token_mask.to(rewards.dtype)
    advantages = per_sample[:, None].expand_as(mask)
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(
                f"`kl` {tuple(kl.shape)} must match token_mask {tuple(mask.shape)} ([B*G, S])."
            )
        # the KL folded into the reward (`use_kl_in_reward`)
        advantages = advantages - kl_coef * kl.to(rewards.dtype)
    # population variance over the global batch's valid tokens, as NeMo RL normalises
    return masked_whiten(advantages, mask, group=group) * mask


def terminal_token_rewards(
    rewards: Tensor, token_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """`[B, S]` token rewards: `rewards [B]` on each row's last valid token, `-kl_coef * kl`
    on every valid one, 0 where `token_mask [B, S]` is 0 (NeMo RL's GAE token rewards)."""
    if rewards.shape != token_mask.shape[:1]:
        raise ValueError(
            f"`rewards` {tuple(rewards.shape)} must be [B] for token_mask {tuple(token_mask.shape)}"
        )
    mask = token_mask.to(rewards.dtype)
    token_rewards = torch.zeros_like(mask)
    if kl is not None:
        # `use_kl_in_reward`: the penalty on every valid token
        token_rewards = token_rewards - kl_coef * kl.to(rewards.dtype)
    width = mask.shape[1]
    last = width - 1 - mask.flip(1).argmax(dim=1)  # [B]
    # an all-masked row has no last token: argmax picked column S-1, zeroed here
    has_tokens = mask.sum(dim=1) > 0
    terminal = torch.zeros_like(mask).scatter(1, last[:, None], rewards[:, None])
    return (token_rewards + terminal * has_tokens[:, None].to(mask.dtype)) * mask


def gae_advantages(
    token_rewards: Tensor, values: Tensor, token_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE (arXiv:1506.02438): `[B, S]` inputs -> `(advantages, returns)` `[B, S]`, 0 where
    masked; `values` holds `V(s_t)` at token `t`, `returns = A + V` are the value targets."""
    if not (token_rewards.shape == values.shape == token_mask.shape) or values.ndim != 2:
        raise ValueError(
            f"`token_rewards` {tuple(token_rewards.shape)}, `values` {tuple(values.shape)} and "
            f"`token_mask` {tuple(token_mask.shape)} must be the same [B, S] shape."
        )
    mask = token_mask.to(values.dtype)
    # V_next/A_next belong to the next VALID token: 0 after the last one (the episode ends)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(next_value)
    columns = []
    # delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # masked positions carry the accumulators over unchanged (NeMo RL's carry-forward
        # masking), so gaps in the mask add no TD error
        next_value = values[:, t] * m + (1 - m) * next_value
        next_advantage = advantage * m + (1 - m) * next_advantage
        columns.append(advantage * m)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, (advantages + values) * mask
