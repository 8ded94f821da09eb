"""The reward protocol and the input checks every built-in shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor


class RewardFunction(Protocol):
    """Scores `B` completions on the host: `[B]` float32 rewards on the CPU; `metadata[i]`
    holds sample `i`'s dataset fields (e.g. `{"answer": "42"}`)."""

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor: ...


class Reward(ABC):
    """The base class of the built-in rewards: a `RewardFunction` a config names by `class_path`."""

    # LightningCLI/jsonargparse instantiate subclasses of a class, not implementations of a
    # callable protocol: hence this base. Any plain function of the protocol works in code.

    @abstractmethod
    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Tensor:
        """`[B]` float32 rewards (see `RewardFunction`)."""


AnyReward = Reward | RewardFunction
"""What takes a reward: a built-in (:class:`Reward`, nameable in configs) or any function."""


def check_reward_inputs(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
) -> None:
    """Check one reward call's batch: `ValueError` if the three lengths differ, `TypeError` if a
    prompt or completion is not a `str` or a metadata entry not a mapping."""
    sizes = {"prompts": len(prompts), "completions": len(completions), "metadata": len(metadata)}
    if len(set(sizes.values())) != 1:
        shown = ", ".join(f"len({name})={size}" for name, size in sizes.items())
        raise ValueError(
            f"A reward takes one prompt, completion and metadata per sample, got {shown}."
        )
    # checked here with the sample index: `re` would fail later without naming the sample
    for name, values, kind in (("prompts", prompts, str), ("completions", completions, str)):
        for index, value in enumerate(values):
            if not isinstance(value, kind):
                raise TypeError(
                    f"`{name}[{index}]` must be a str, got {type(value).__name__}: {value!r}."
                )
    for index, entry in enumerate(metadata):
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"`metadata[{index}]` must be a mapping of the sample's fields, got "
                f"{type(entry).__name__}."
            )


def metadata_value(metadata: Mapping[str, Any], key: str, index: int) -> Any:
    """`metadata[key]` of sample `index`; `ValueError` naming the keys present if missing."""
    if key not in metadata:
        raise ValueError(
            f"`metadata[{index}]` has no key {key!r} (the reference answer); its keys: "
            f"{sorted(metadata)}."
        )
    return metadata[key]


def score_each(
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    score: Callable[[str, str, Mapping[str, Any], int], float],
) -> Tensor:
    """`[B]` float32: `score(prompt, completion, metadata, index)` per sample of a checked batch."""
    check_reward_inputs(prompts, completions, metadata)
    values = [
        score(prompt, completion, meta, index)
        for index, (prompt, completion, meta) in enumerate(
            zip(prompts, completions, metadata, strict=True)
        )
    ]
    return torch.tensor(values, dtype=torch.float32)
