"""Toy tasks with verifiable rewards, small enough for a tiny GPT to learn on CPU in minutes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ModularCountingTask:
    """Continue a random prompt by counting modulo ``modulus``: every completion token ``t_i``
    should satisfy ``t_i % m == (t_{i-1} + 1) % m``, its predecessor being the previous
    completion token or, for the first one, the prompt's last token.

    The reward is the fraction of completion tokens that follow the rule: a uniformly random policy
    scores ``1/modulus``, the optimum is 1, and repeating a token scores 0, so a rising reward shows
    that the policy learned a rule conditioned on its context, not a fixed token preference.

    Attributes:
        vocab_size: prompts draw from ``[0, vocab_size)``.
        prompt_length: ``P``.
        modulus: ``m``, the number of residue classes (difficulty).
    """

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
        expected = (tokens[:, :-1] + 1) % self.modulus  # residue each next token should have
        hits = (tokens[:, 1:] % self.modulus == expected) & completion_mask[:, 1:].bool()
        return hits.sum(dim=1).float() / completion_mask.sum(dim=1).clamp(min=1).float()
