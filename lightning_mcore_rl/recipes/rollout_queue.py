"""Asynchronous GRPO's look-ahead: the rollouts of the next ``max_staleness`` prompt batches."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from lightning_mcore_rl.rollout import SubmittedRollout

Start = Callable[[Any, int], SubmittedRollout]
"""``(prompts, ahead) -> SubmittedRollout``: submit the rollout of a prompt batch that trains
``ahead`` steps after the current one."""


# A background source (a vLLM engine, the HF copy) samples the submitted rollouts while the trainer
# trains; a batch is then trained by weights up to max_staleness optimizer steps newer than those
# that sampled it (one-step off-policy at max_staleness=1).


class _Queued(NamedTuple):
    prompts: Any
    submitted: SubmittedRollout


class RolloutQueue:
    """The rollouts submitted up to ``max_staleness`` batches ahead of their steps, in order."""

    def __init__(self, max_staleness: int) -> None:
        # 0: nothing ahead, every rollout is submitted by the step that trains it
        if max_staleness < 0:
            raise ValueError(f"`max_staleness` must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._queue: deque[_Queued] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def take(self, prompts: Any, upcoming: Sequence[Any], start: Start) -> SubmittedRollout:
        """The rollout of this step's ``prompts`` (submitted ahead, or now); then submit those of
        the ``upcoming`` batches (at most ``max_staleness``) not submitted yet.

        Raises:
            ValueError: more than ``max_staleness`` upcoming batches.
            RuntimeError: ``prompts`` are not the batch submitted ahead for this step."""
        if len(upcoming) > self.max_staleness:
            raise ValueError(
                f"{len(upcoming)} upcoming batches, at most max_staleness={self.max_staleness}"
            )
        if self._queue:
            queued = self._queue.popleft()
            # the loader's look-ahead (peek) must have shown the batches it then yields
            if not same_prompts(queued.prompts, prompts):
                raise RuntimeError(
                    "The prompt batch of this step is not the one its rollout was submitted for "
                    "a step ahead: the train loader's peek() showed another batch than it "
                    "yielded."
                )
            current = queued.submitted
        else:
            current = start(prompts, 0)
        for ahead, batch in enumerate(upcoming, start=1):
            # the batches already queued were submitted by an earlier step
            if ahead > len(self._queue):
                self._queue.append(_Queued(batch, start(batch, ahead)))
        return current

    def clear(self) -> None:
        """Drop the submitted rollouts."""
        # their sampling is waited for by the rollout's wait(); their collective result() is
        # never called, on any rank
        self._queue.clear()


def same_prompts(a: Any, b: Any) -> bool:
    """Whether two prompt batches hold the same prompts (tensors, or `PromptBatch` ids/lengths)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return all(
        torch.equal(getattr(a, key), getattr(b, key)) for key in ("input_ids", "input_lengths")
    )
