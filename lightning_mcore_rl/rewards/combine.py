"""A weighted sum of rewards."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.rewards.base import AnyReward, Reward, check_reward_inputs


class WeightedReward(Reward):
    """`sum_r weights[r] * rewards[r](prompts, completions, metadata)`.

    Args:
        rewards: `R >= 1` reward functions.
        weights: `R` finite weights (default: 1 each).
    """

    def __init__(
        self, rewards: Sequence[AnyReward], weights: Sequence[float] | None = None
    ) -> None:
        if not rewards:
            raise ValueError("`rewards` must hold at least one reward function.")
        weights = [1.0] * len(rewards) if weights is None else [float(w) for w in weights]
        if len(weights) != len(rewards):
            raise ValueError(
                f"`weights` must hold one weight per reward: {len(rewards)} rewards, "
                f"{len(weights)} weights."
            )
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"`weights` must be finite, got {weights}.")
        self.rewards = list(rewards)
        # float32 like the scores, for the `[R] @ [R, B]` product in __call__
        self.weights = torch.tensor(weights, dtype=torch.float32)

    def scores(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """Each reward's unweighted `[R, B]` float32 scores; `ValueError` if one is not `[B]`."""
        check_reward_inputs(prompts, completions, metadata)
        rows = []
        for index, reward in enumerate(self.rewards):
            row = reward(prompts, completions, metadata)
            # a plain function may return anything: name the culprit before `stack` fails
            if not isinstance(row, Tensor) or tuple(row.shape) != (len(completions),):
                shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
                raise ValueError(
                    f"`rewards[{index}]` ({type(reward).__name__}) must return a [B] tensor with "
                    f"B={len(completions)}, got {shape}."
                )
            # a user reward may score on the GPU or in another dtype; the sum is on the host
            rows.append(row.to(device="cpu", dtype=torch.float32))
        return torch.stack(rows)  # [R, B]

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """`[B]` float32 weighted sums (see `RewardFunction`)."""
        return self.weights @ self.scores(prompts, completions, metadata)  # [R] @ [R, B]
