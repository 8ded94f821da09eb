"""Toy tasks with verifiable rewards, small enough for a tiny GPT to learn on CPU in minutes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ModularMatchTask:
    """Continue a random prompt with tokens congruent to its last token modulo ``modulus``.

    The reward of a completion is the fraction of its tokens ``t`` with
    ``t % modulus == prompt[-1] % modulus``; a uniformly random policy scores ``1/modulus``, the
    optimum is 1. The policy must read the prompt (the target class changes per prompt), so a
    rising reward shows real conditional learning, not a fixed token preference.

    Attributes:
        vocab_size: prompts draw from ``[0, vocab_size)``.
        prompt_length: ``P``.
        modulus: number of residue classes (difficulty).
    """

    vocab_size: int = 128
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
        target = tokens[:, self.prompt_length - 1] % self.modulus  # [B]
        hits = (tokens % self.modulus == target[:, None]) & completion_mask.bool()
        return hits.sum(dim=1).float() / completion_mask.sum(dim=1).clamp(min=1).float()
