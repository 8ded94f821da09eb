"""GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath, §4.1.2).

Samples are laid out group-major: the ``G`` completions of prompt ``i`` are rows ``i*G .. i*G+G-1``.
"""

from __future__ import annotations

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


def token_level_advantages(advantages: Tensor, token_mask: Tensor) -> Tensor:
    """Broadcast per-sample advantages ``[B]`` onto tokens: ``[B, S]``, zero where masked."""
    if advantages.shape != token_mask.shape[:1]:
        raise ValueError(
            f"`advantages` {tuple(advantages.shape)} must be [B] for token_mask "
            f"{tuple(token_mask.shape)}"
        )
    return advantages[:, None] * token_mask.to(advantages.dtype)
