"""RL algorithm pieces that are pure tensor code: advantages and baselines."""

from lightning_mcore_rl.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    terminal_token_rewards,
    token_level_advantages,
)

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "masked_whiten",
    "reinforce_plus_plus_advantages",
    "terminal_token_rewards",
    "token_level_advantages",
]
