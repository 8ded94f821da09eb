"""RL algorithm pieces that are pure tensor code: advantages and baselines."""

from lightning_mcore_rl.algorithms.advantages import grpo_advantages, token_level_advantages

__all__ = ["grpo_advantages", "token_level_advantages"]
