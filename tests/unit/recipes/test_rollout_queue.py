"""Asynchronous GRPO's look-ahead (``RolloutQueue``) and who accepts ``max_staleness``: a step
takes the rollout submitted ahead for its batch and submits the next ones in loader order; a
batch other than the one submitted ahead is an error; only ``GRPOModule`` samples ahead."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mcore_rl.recipes import DistillationModule, PPOModule, RolloutSpec
from lightning_mcore_rl.recipes.prompt_data import PromptBatch
from lightning_mcore_rl.recipes.rollout_queue import RolloutQueue, same_prompts
from lightning_mcore_rl.rollout import ReadyRollout, Rollout, SubmittedRollout


class _Starts:
    """A ``start`` that records what it was asked to submit, and when (the step's index)."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: list[tuple[int, int, int]] = []  # (step, batch id, steps ahead)

    def __call__(self, prompts: torch.Tensor, ahead: int) -> SubmittedRollout:
        self.calls.append((self.step, int(prompts[0, 0]), ahead))
        empty = torch.zeros(1, 1)
        return SubmittedRollout(ReadyRollout(Rollout(prompts, empty, empty, empty)), self.step)


def _batch(i: int) -> torch.Tensor:
    return torch.full((2, 3), i)


def test_each_step_takes_its_batch_and_submits_the_next_ones_once():
    queue, start = RolloutQueue(2), _Starts()
    taken = []
    for step in range(5):
        start.step = step
        upcoming = [_batch(i) for i in range(step + 1, min(step + 3, 5))]  # peek(2), 5 batches
        taken.append(queue.take(_batch(step), upcoming, start))
    # step 0 submits its own batch and the next two; later steps only the newly visible one
    assert start.calls == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 3, 2), (2, 4, 2)]
    assert [t.weights_step for t in taken] == [0, 0, 0, 1, 2]  # staleness 0, 1, 2, 2, 2
    assert [int(t.pending.result().tokens[0, 0]) for t in taken] == [0, 1, 2, 3, 4]
    assert len(queue) == 0


def test_max_staleness_zero_submits_nothing_ahead():
    queue, start = RolloutQueue(0), _Starts()
    queue.take(_batch(0), [], start)
    assert start.calls == [(0, 0, 0)] and len(queue) == 0
    with pytest.raises(ValueError, match="1 upcoming batches, at most max_staleness=0"):
        queue.take(_batch(1), [_batch(2)], start)


def test_another_batch_than_the_one_submitted_ahead_is_an_error():
    queue, start = RolloutQueue(1), _Starts()
    queue.take(_batch(0), [_batch(1)], start)
    with pytest.raises(RuntimeError, match="not the one its rollout was submitted for"):
        queue.take(_batch(7), [], start)


def test_same_prompts_compares_tensors_and_prompt_batches():
    ids, lengths = torch.tensor([[0, 5, 6]]), torch.tensor([2])

    def prompt_batch(**change: Any) -> PromptBatch:
        fields: dict[str, Any] = {
            "input_ids": ids, "input_lengths": lengths, "prompts": ["a"], "metadata": [{}],
            "indices": torch.tensor([4]),
        }  # fmt: skip
        return PromptBatch(**{**fields, **change})

    assert same_prompts(_batch(1), _batch(1)) and not same_prompts(_batch(1), _batch(2))
    assert not same_prompts(_batch(1), prompt_batch())
    assert same_prompts(prompt_batch(), prompt_batch(prompts=["other text"]))
    assert not same_prompts(prompt_batch(), prompt_batch(input_lengths=torch.tensor([3])))


def test_only_grpo_samples_ahead():
    with pytest.raises(ValueError, match="`max_staleness` must be >= 0, got -1"):
        RolloutSpec(max_staleness=-1)
    with pytest.raises(ValueError, match="`max_staleness=1` cannot be combined with `top_k=5`"):
        RolloutSpec(max_staleness=1, top_k=5)
    ahead = RolloutSpec(max_staleness=1)
    with pytest.raises(ValueError, match="PPOModule samples synchronously"):
        PPOModule(rollout=ahead)
    with pytest.raises(ValueError, match="DistillationModule samples synchronously"):
        DistillationModule(rollout=ahead)
    with pytest.raises(ValueError, match="PPOModule samples without top-k/top-p: .* got 5 and 1.0"):
        PPOModule(rollout=RolloutSpec(top_k=5))
    with pytest.raises(ValueError, match="DistillationModule samples without top-k/top-p"):
        DistillationModule(rollout=RolloutSpec(top_p=0.9))
