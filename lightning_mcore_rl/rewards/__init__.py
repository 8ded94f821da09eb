"""Reward functions over text: score a batch of completions on the host.

Every reward follows :class:`RewardFunction` (the built-ins derive from :class:`Reward`, so configs
name them by ``class_path``): ``(prompts, completions, metadata) -> Tensor [B]``
(float32, CPU), one score per completion, where ``metadata[i]`` holds sample ``i``'s dataset fields
(e.g. the reference ``"answer"``). Malformed input (lists of different lengths, a missing metadata
key, an unreadable reference answer) raises a ``ValueError`` naming the argument or key and the
sample index; a malformed *completion* (no number, wrong format, empty) scores 0.

Built-ins: :class:`ExactMatchReward`, :class:`NumericAnswerReward` (the ``\\boxed{...}`` answer or
else the last number, within a tolerance), :class:`FormatReward` (a regular expression, or required
tags), :class:`WeightedReward` (a weighted sum of several). See ``docs/data.md``.
"""

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
