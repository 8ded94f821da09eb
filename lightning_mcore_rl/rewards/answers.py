"""Answer verification: exact match and numeric answers (`\\boxed{...}` or the last number)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_mcore_rl.rewards.base import Reward, metadata_value, score_each

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_PLAIN_NUMBER = re.compile(rf"[-+]?{_NUMBER}")
# a number in running text: thousands separators allowed ("1,234"); a sign only where it cannot
# be a hyphen between words or numbers ("3-5" ends in 5, not -5)
_TEXT_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])[-+])?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|" + _NUMBER + r")"
)
# `\frac{a}{b}`, `\dfrac{a}{b}` (LaTeX) or `a/b`
_FRACTION = re.compile(
    rf"\\d?frac\{{([-+]?{_NUMBER})\}}\{{([-+]?{_NUMBER})\}}|([-+]?{_NUMBER})/({_NUMBER})"
)
_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, nested braces kept; `None` if absent."""
    # a regular expression cannot match nested braces: count the depth instead
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for pos in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[begin:pos]
    # the box never closes (e.g. a completion cut at the length limit)
    return None


def parse_number(text: str) -> float | None:
    """`text` as one number (`42`, `-3.5`, `1e-3`, `1,234`, `3/4`, `\\frac{3}{4}`, in `$...$`)."""
    # LaTeX answers come in math mode (`$...$`), often with spaces around operators
    value = text.strip().strip("$").replace(" ", "")
    value = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", value)  # thousands separators
    if _PLAIN_NUMBER.fullmatch(value):
        return float(value)
    fraction = _FRACTION.fullmatch(value)
    if fraction is None:
        return None
    numerator, denominator = (g for g in fraction.groups() if g is not None)
    # `1/0` is not a number, not a ZeroDivisionError
    return float(numerator) / float(denominator) if float(denominator) != 0 else None


def extract_numeric_answer(completion: str) -> float | None:
    """The last `\\boxed{...}`'s number, else the last number in the text, else `None`."""
    if _BOXED in completion:
        # an unreadable box gives None, not a fallback to the text: the completion chose to box
        boxed = last_boxed(completion)
        return None if boxed is None else parse_number(boxed)
    # the last number: a worked solution ends with its result
    numbers = _TEXT_NUMBER.findall(completion)
    return float(numbers[-1].replace(",", "")) if numbers else None


def _reference_number(value: Any, key: str, index: int) -> float:
    """The reference answer `value` of sample `index` as a float (`ValueError` if none)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number: float | None = float(value)
    else:
        number = parse_number(value) if isinstance(value, str) else None
    if number is None or not math.isfinite(number):
        raise ValueError(
            f"`metadata[{index}][{key!r}]` must be a finite number or a string holding one, got "
            f"{type(value).__name__} {value!r}."
        )
    return number


@dataclass(frozen=True)
class NumericAnswerReward(Reward):
    """1 when `extract_numeric_answer`'s answer is `math.isclose` to the reference, else 0.

    Attributes:
        answer_key: the metadata key of the reference (a number or a string such as `"3/4"`).
        abs_tol: absolute tolerance.
        rel_tol: relative tolerance.
    """

    answer_key: str = "answer"
    abs_tol: float = 1e-6
    rel_tol: float = 0.0

    def __post_init__(self) -> None:
        if not (self.abs_tol >= 0 and self.rel_tol >= 0):
            raise ValueError(
                f"`abs_tol` and `rel_tol` must be >= 0, got {self.abs_tol} and {self.rel_tol}."
            )

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """`[B]` float32 rewards in {0, 1} (see `RewardFunction`)."""
        return score_each(prompts, completions, metadata, self._score)

    def _score(self, prompt: str, completion: str, meta: Mapping[str, Any], index: int) -> float:
        # the reference is read first: a bad one raises even for a completion without an answer
        reference = metadata_value(meta, self.answer_key, index)
        expected = _reference_number(reference, self.answer_key, index)
        answer = extract_numeric_answer(completion)
        if answer is None:  # no answer in the completion: a wrong one, not an error
            return 0.0
        return float(math.isclose(answer, expected, rel_tol=self.rel_tol, abs_tol=self.abs_tol))


@dataclass(frozen=True)
class ExactMatchReward(Reward):
    """1 when the completion (or its last `\\boxed{...}`) equals the reference string, else 0.

    Attributes:
        answer_key: the metadata key of the reference (a `str`, or an `int` as its decimal text).
        ignore_case: compare case-insensitively (`str.casefold`).
        boxed: compare the last `\\boxed{...}` (none: 0) instead of the whole completion.
    """

    answer_key: str = "answer"
    ignore_case: bool = False
    boxed: bool = False

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """`[B]` float32 rewards in {0, 1} (see `RewardFunction`)."""
        return score_each(prompts, completions, metadata, self._score)

    def _normalize(self, text: str) -> str:
        # both sides stripped, runs of whitespace collapsed to one space
        text = " ".join(text.split())
        return text.casefold() if self.ignore_case else text

    def _score(self, prompt: str, completion: str, meta: Mapping[str, Any], index: int) -> float:
        reference = metadata_value(meta, self.answer_key, index)
        # a float reference has no one decimal text to match (NumericAnswerReward compares it)
        if isinstance(reference, bool) or not isinstance(reference, (str, int)):
            raise ValueError(
                f"`metadata[{index}][{self.answer_key!r}]` must be a str or an int for an exact "
                f"match, got {type(reference).__name__} {reference!r}."
            )
        answer = last_boxed(completion) if self.boxed else completion
        if answer is None:
            return 0.0
        return float(self._normalize(answer) == self._normalize(str(reference)))
