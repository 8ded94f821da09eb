"""Toy tasks with verifiable rewards, small enough for a tiny GPT to learn on CPU in minutes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ModularCountingTask:
    """Continue a random prompt (ids in ``[0, vocab_size)``) by counting modulo ``modulus``:
    reward = the fraction of completion tokens with ``t_i % m == (t_{i-1} + 1) % m``."""

    vocab_size: int = 16
    prompt_length: int = 8
    modulus: int = 4

    def __post_init__(self) -> None:
        if not 2 <= self.modulus <= self.vocab_size:
            raise ValueError(
                f"`modulus` must be in [2, vocab_size={self.vocab_size}], got {self.modulus}"
            )
        if self.prompt_length < 1:
            raise ValueError(f"`prompt_length` must be >= 1, got {self.prompt_length}")

    def prompts(self, num_prompts: int, generator: torch.Generator) -> Tensor:
        """``[num_prompts, P]`` random prompts."""
        return torch.randint(
            0, self.vocab_size, (num_prompts, self.prompt_length), generator=generator
        )

    def rewards(self, tokens: Tensor, completion_mask: Tensor) -> Tensor:
        """``[B]`` rewards for ``tokens [B, P+N]`` whose completion positions are ``completion_mask``."""
        # a uniformly random policy scores 1/modulus and repeating a token scores 0, so a rising
        # reward shows a rule conditioned on the context was learned, not a token preference
        expected = (tokens[:, :-1] + 1) % self.modulus  # residue each next token should have
        hits = (tokens[:, 1:] % self.modulus == expected) & completion_mask[:, 1:].bool()
        return hits.sum(dim=1).float() / completion_mask.sum(dim=1).clamp(min=1).float()
