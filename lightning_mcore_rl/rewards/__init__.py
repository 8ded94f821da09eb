"""Reward functions over text: `(prompts, completions, metadata) -> [B]` float32 on the CPU.

Built-ins: exact match, numeric answer, format (regex or tags), weighted sum; see `docs/data.md`."""

# Malformed input (lists of different lengths, a missing metadata key, an unreadable reference
# answer) raises a `ValueError` naming the argument or key and the sample index: it is a bug in
# the data or the config. A malformed *completion* (no number, wrong format, empty) scores 0: it
# is what the policy is being trained away from.

from lightning_mcore_rl.rewards.answers import (
    ExactMatchReward,
    NumericAnswerReward,
    extract_numeric_answer,
    parse_number,
)
from lightning_mcore_rl.rewards.base import (
    AnyReward,
    Reward,
    RewardFunction,
    check_reward_inputs,
    score_each,
)
from lightning_mcore_rl.rewards.combine import WeightedReward
from lightning_mcore_rl.rewards.format import FormatReward

__all__ = [
    "AnyReward",
    "ExactMatchReward",
    "FormatReward",
    "NumericAnswerReward",
    "Reward",
    "RewardFunction",
    "WeightedReward",
    "check_reward_inputs",
    "extract_numeric_answer",
    "parse_number",
    "score_each",
]
