"""Locally generated supervised and preference data for the counting task (no download): rows
``[P + N]`` of a task prompt, a response of ``1..N`` tokens, right padding with id 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from lightning_mcore_rl.rollout import ModularCountingTask


def demonstration(task: ModularCountingTask, prompts: Tensor, length: int) -> Tensor:
    """The correct ``length``-token continuation ``[n, N]`` of ``prompts [n, P]``."""
    # the smallest id of each next residue: one right answer per position, reward 1
    steps = torch.arange(1, length + 1)  # the i-th response token is i counts past the prompt
    return (prompts[:, -1:] + steps) % task.modulus


def random_continuation(
    task: ModularCountingTask,
    prompts: Tensor,
    length: int,
    generator: torch.Generator,
    follow_rule: bool,
) -> Tensor:
    """A random ``length``-token continuation ``[n, N]`` of ``prompts [n, P]`` whose every token
    follows the counting rule (``follow_rule``: reward 1) or breaks it (reward 0)."""
    # Each token's residue is (or is not) its predecessor's + 1, its id uniform among those of
    # that residue: chosen and rejected both spread over the whole vocabulary, so only the rule
    # tells them apart.
    m, v = task.modulus, task.vocab_size
    tokens, previous = [], prompts[:, -1]
    for _ in range(length):
        offset = 0 if follow_rule else torch.randint(1, m, previous.shape, generator=generator)
        residue = (previous + 1 + offset) % m
        count = (v - 1 - residue) // m + 1  # ids residue + m*k below V
        k = (torch.rand(previous.shape, generator=generator) * count).long()
        previous = residue + m * k
        tokens.append(previous)
    return torch.stack(tokens, dim=1)


def _rows(prompts: Tensor, responses: Tensor, lengths: Tensor) -> dict[str, Tensor]:
    """Batch rows ``[n, P + N]`` of prompts followed by the first ``lengths`` response tokens."""
    n, p = prompts.shape
    width = p + responses.shape[1]
    positions = torch.arange(width)[None, :]
    input_lengths = p + lengths
    response = (positions >= p) & (positions < input_lengths[:, None])
    ids = torch.zeros(n, width, dtype=torch.long)
    ids[:, :p] = prompts
    ids[:, p:] = responses
    return {
        "input_ids": ids * (positions < input_lengths[:, None]),
        "input_lengths": input_lengths,
        "token_mask": response.float(),
        "sample_mask": torch.ones(n),
    }


class CountingSFTDataset(Dataset):
    """``num_samples`` prompt/demonstration rows: ``input_ids``, ``token_mask`` (response)
    ``[P+N]``, ``input_lengths``, ``sample_mask`` ``[]``; responses of 1 to ``max_new_tokens``."""

    def __init__(
        self, task: ModularCountingTask, num_samples: int, max_new_tokens: int, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        prompts = task.prompts(num_samples, generator)
        lengths = torch.randint(1, max_new_tokens + 1, (num_samples,), generator=generator)
        self.rows = _rows(prompts, demonstration(task, prompts, max_new_tokens), lengths)

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.rows.items()}


class CountingPreferenceDataset(Dataset):
    """``num_pairs`` chosen (rule-following) / rejected (rule-breaking) pairs of one prompt and
    length, items `CountingSFTDataset`'s as ``[2, ...]`` (chosen first)."""

    def __init__(
        self,
        task: ModularCountingTask,
        num_pairs: int,
        max_new_tokens: int,
        seed: int = 0,
        chosen_demonstration: bool = False,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        prompts = task.prompts(num_pairs, generator)
        lengths = torch.randint(1, max_new_tokens + 1, (num_pairs,), generator=generator)
        # chosen_demonstration: the SFT demonstration (ids below m), an easier task: its ids
        # alone nearly tell the pair apart
        chosen = (
            demonstration(task, prompts, max_new_tokens)
            if chosen_demonstration
            else random_continuation(task, prompts, max_new_tokens, generator, follow_rule=True)
        )
        rejected = random_continuation(task, prompts, max_new_tokens, generator, follow_rule=False)
        good, bad = (_rows(prompts, response, lengths) for response in (chosen, rejected))
        self.rows = {key: torch.stack([good[key], bad[key]], dim=1) for key in good}

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.rows.items()}


def collate_pairs(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack ``b`` pair items ``{key: [2, ...]}`` into a batch ``{key: [2b, ...]}``."""
    # rows chosen_0, rejected_0, chosen_1, ...: the layout the preference losses read
    batch: dict[str, Any] = default_collate(items)  # {key: [b, 2, ...]}
    return {key: value.flatten(0, 1) for key, value in batch.items()}
