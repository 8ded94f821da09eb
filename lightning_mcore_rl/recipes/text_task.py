"""A text task for the RL recipes: file prompts (`PromptBatch`), completions decoded with the
policy's tokenizer and scored on the host by a reward function (`lightning_mcore_rl.rewards`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_mcore_rl.recipes.prompt_data import PromptBatch
from lightning_mcore_rl.rewards import AnyReward
from lightning_mcore_rl.rollout import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Shapes: b prompts of this DP rank, G completions per prompt, B = b*G sampled rows (group-major),
# P prompt columns, N new tokens.


@dataclass
class TextRewardTask:
    """Rewarded text completions of file prompts.

    Attributes:
        reward: scores ``(prompts, completions, metadata) -> [B]`` (e.g. `NumericAnswerReward`).
        max_prompt_length: ``P`` at most (the data module's ``max_prompt_length`` at most this)."""

    # metadata are the prompt rows' fields, e.g. {"answer": "42"}
    reward: AnyReward
    # with the rollout's max_new_tokens it bounds the rows the model sees
    max_prompt_length: int

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1, got {self.max_prompt_length}.")
        if not callable(self.reward):
            raise TypeError(
                f"`reward` must be a reward function (prompts, completions, metadata) -> [B], "
                f"got {type(self.reward).__name__}."
            )

    def prompts(self, batch: PromptBatch) -> tuple[Tensor, Tensor]:
        """This rank's left-padded prompt ids ``[b, P]`` and real lengths ``[b]``.

        Raises:
            TypeError: ``batch`` is not a `PromptBatch`.
            ValueError: right-padded prompts, or ``P`` above ``max_prompt_length``."""
        if not isinstance(batch, PromptBatch):
            raise TypeError(
                f"TextRewardTask takes PromptBatch batches (PromptFileDataModule), got "
                f"{type(batch).__name__}."
            )
        # sampling starts after each prompt's last token
        if batch.padding_side != "left":
            raise ValueError(
                "TextRewardTask samples after each prompt's last token: the prompts must be "
                f"left-padded (PromptFileDataModule(padding_side='left')), got "
                f"{batch.padding_side!r}."
            )
        width = int(batch.input_ids.shape[1])
        if width > self.max_prompt_length:
            raise ValueError(
                f"A prompt batch is {width} tokens wide, above TextRewardTask(max_prompt_length="
                f"{self.max_prompt_length}); filter the data with the same max_prompt_length."
            )
        return batch.input_ids, batch.input_lengths

    def rewards(
        self,
        batch: PromptBatch,
        out: Rollout,
        group_size: int,
        tokenizer: PreTrainedTokenizerBase,
    ) -> Tensor:
        """``[B]`` float32 rewards of the ``B = b*G`` group-major rows ``out`` of ``batch``.

        Raises:
            ValueError: the reward returns other than ``B`` finite values."""
        # a completion's completion_mask tokens, special tokens such as the stop token skipped
        completions = [
            str(tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True))
            for row, mask in zip(out.tokens, out.completion_mask, strict=True)
        ]
        # group-major: prompt i's completions are rows i*G .. i*G + G - 1
        prompts = [text for text in batch.prompts for _ in range(group_size)]
        metadata: list[Any] = [meta for meta in batch.metadata for _ in range(group_size)]
        rewards = torch.as_tensor(self.reward(prompts, completions, metadata), dtype=torch.float32)
        if rewards.shape != (len(completions),) or not bool(torch.isfinite(rewards).all()):
            raise ValueError(
                f"{type(self.reward).__name__} must return {len(completions)} finite rewards "
                f"(one per completion), got shape {tuple(rewards.shape)}: {rewards.tolist()}."
            )
        return rewards

    def describe(self) -> dict[str, Any]:
        """The task's settings for the run's hyperparameters."""
        return {"reward": repr(self.reward), "max_prompt_length": self.max_prompt_length}
