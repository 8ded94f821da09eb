"""Format rewards: does the completion match a regular expression (e.g. required tags)?"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_mcore_rl.rewards.base import Reward, score_each


@dataclass(frozen=True)
class FormatReward(Reward):
    """1 when the completion matches `pattern`, else 0.

    Attributes:
        pattern: a Python regular expression, compiled with `re.DOTALL` (`.` crosses lines).
        full_match: the stripped completion must `re.fullmatch`; `False`: `re.search` anywhere.
    """

    pattern: str
    full_match: bool = True
    # compiled once in __post_init__: not a constructor argument, not part of equality
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            regex = re.compile(self.pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(
                f"`pattern` {self.pattern!r} is not a regular expression: {err}"
            ) from err
        object.__setattr__(self, "_regex", regex)  # frozen dataclass: set once here

    @classmethod
    def with_tags(cls, *tags: str) -> FormatReward:
        """The completion is the blocks `<tag>...</tag>` in this order and nothing else."""
        # whitespace between the blocks is allowed; `.*?` keeps a block from spanning the next
        if not tags:
            raise ValueError("`with_tags` needs at least one tag name.")
        blocks = r"\s*".join(rf"<{re.escape(t)}>.*?</{re.escape(t)}>" for t in tags)
        # full_match: any text outside the blocks fails the format
        return cls(blocks, full_match=True)

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """`[B]` float32 rewards in {0, 1} (see `RewardFunction`)."""
        return score_each(prompts, completions, metadata, self._score)

    def _score(self, prompt: str, completion: str, meta: Mapping[str, Any], index: int) -> float:
        if self.full_match:
            return float(self._regex.fullmatch(completion.strip()) is not None)
        return float(self._regex.search(completion) is not None)
