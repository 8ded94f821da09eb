"""Locally generated supervised and preference data for the counting task (no download).

Rows are ``[P + N]`` wide: a task prompt of ``P`` tokens, a response of ``1..N`` tokens, right
padding with id 0. The demonstration of :class:`~lightning_mcore_rl.rollout.ModularCountingTask`
continues the count modulo ``m`` with the smallest id of each residue: ``r_i = (r_{i-1} + 1) % m``
(``r_0`` follows the prompt's last token), so it scores reward 1; a rejected response has a wrong
residue at every position (relative to its own predecessor) and scores 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from lightning_mcore_rl.rollout import ModularCountingTask


def demonstration(task: ModularCountingTask, prompts: Tensor, length: int) -> Tensor:
    """The correct ``length``-token continuation ``[n, N]`` of ``prompts [n, P]``."""
    steps = torch.arange(1, length + 1)  # the i-th response token is i counts past the prompt
    return (prompts[:, -1:] + steps) % task.modulus


def rule_breaking(
    task: ModularCountingTask, prompts: Tensor, length: int, generator: torch.Generator
) -> Tensor:
    """A random ``length``-token continuation ``[n, N]`` of ``prompts [n, P]`` whose every token
    breaks the counting rule: its residue differs from its predecessor's + 1 (reward 0)."""
    m, v = task.modulus, task.vocab_size
    tokens, previous = [], prompts[:, -1]
    for _ in range(length):
        offset = torch.randint(1, m, previous.shape, generator=generator)  # off by 1..m-1
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
    """``num_samples`` prompt/demonstration rows (map-style).

    Args:
        task: the prompts' task.
        num_samples: rows.
        max_new_tokens: ``N``, the longest response (each response has ``1..N`` tokens).
        seed: prompt and length seed.

    Items: ``input_ids [P+N]``, ``input_lengths []``, ``token_mask [P+N]`` (1 on the response
    tokens), ``sample_mask []``.
    """

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
    """``num_pairs`` chosen/rejected pairs (map-style): one prompt, the demonstration (chosen) and
    a random response that breaks the rule at every token (rejected), both of the pair's length.

    Args:
        task: the prompts' task.
        num_pairs: pairs.
        max_new_tokens: ``N``, the longest response (each pair has ``1..N`` tokens).
        seed: prompt, length and rejected-token seed.

    Items: every key of :class:`CountingSFTDataset` with a leading pair dimension ``[2, ...]``
    (chosen first); :func:`collate_pairs` interleaves them.
    """

    def __init__(
        self, task: ModularCountingTask, num_pairs: int, max_new_tokens: int, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        prompts = task.prompts(num_pairs, generator)
        lengths = torch.randint(1, max_new_tokens + 1, (num_pairs,), generator=generator)
        chosen = demonstration(task, prompts, max_new_tokens)
        rejected = rule_breaking(task, prompts, max_new_tokens, generator)
        good, bad = (_rows(prompts, response, lengths) for response in (chosen, rejected))
        self.rows = {key: torch.stack([good[key], bad[key]], dim=1) for key in good}

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[index] for key, value in self.rows.items()}


def collate_pairs(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack ``b`` pair items ``{key: [2, ...]}`` into the interleaved preference batch
    ``{key: [2b, ...]}``: rows ``chosen_0, rejected_0, chosen_1, ...``."""
    batch: dict[str, Any] = default_collate(items)  # {key: [b, 2, ...]}
    return {key: value.flatten(0, 1) for key, value in batch.items()}
