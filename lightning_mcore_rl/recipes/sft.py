"""Supervised fine-tuning: next-token NLL on the response tokens of prompt/response rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from lightning_mcore_rl.losses import NLLLossFn
from lightning_mcore_rl.recipes.common import (
    DEFAULT_TASK,
    HFModelSpec,
    RecipeModel,
    RecipeModule,
    TinyGPTSpec,
    agree_on_batch,
    check_rows,
    check_step_microbatches,
    rank_train_loader,
    rank_val_loader,
)
from lightning_mcore_rl.recipes.toy_data import CountingSFTDataset
from lightning_mcore_rl.rollout import ModularCountingTask
from lightning_mcore_rl.strategy import ResumableLoader

SFT_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")
"""The batch keys :class:`SFTModule` reads."""


class SFTDataModule(LightningDataModule):
    """Demonstrations of the counting task, ``samples_per_step`` rows per optimizer step.

    Args:
        task: the prompts' task (``V = task.vocab_size``, ``P = task.prompt_length``).
        max_new_tokens: ``N``, the longest response; rows are ``P + N`` wide.
        samples_per_step: global rows per optimizer step (divisible by DP).
        num_steps: steps' worth of distinct rows (one epoch).
        seed: data seed, also the seed of the (per-epoch) shuffled order.
        val_samples: held-out rows (0: no validation loop), divisible by DP.
        val_seed: seed of the held-out rows."""

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        max_new_tokens: int = 8,
        samples_per_step: int = 16,
        num_steps: int = 40,
        seed: int = 0,
        val_samples: int = 0,
        val_seed: int = 1,
    ) -> None:
        super().__init__()
        self.task = task or ModularCountingTask()
        self.max_new_tokens = max_new_tokens
        self.samples_per_step = samples_per_step
        self.num_steps = num_steps
        self.seed = seed
        self.val_samples = val_samples
        self.val_seed = val_seed

    def train_dataloader(self) -> ResumableLoader:
        """This rank's ``samples_per_step / DP`` rows per step (resumable mid-epoch)."""
        num = self.samples_per_step * self.num_steps
        dataset = CountingSFTDataset(self.task, num, self.max_new_tokens, self.seed)
        return rank_train_loader(
            self.trainer, dataset, self.samples_per_step, "samples_per_step", self.seed
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Held-out rows (``val_samples``; none when 0), split over data-parallel ranks."""
        if self.val_samples == 0:
            return []
        dataset = CountingSFTDataset(
            self.task, self.val_samples, self.max_new_tokens, self.val_seed
        )
        return rank_val_loader(self.trainer, dataset, self.samples_per_step, "val_samples")


class SFTModule(RecipeModule):
    """Supervised fine-tuning of a tiny GPT or a Hugging Face model on `SFT_KEYS` batches.

    Args:
        model: a tiny GPT (`TinyGPTSpec`) or a Hugging Face checkpoint (`HFModelSpec`).
        vocab_size: ``V`` of the data (the tiny GPT's vocabulary; an HF model's must cover it).
        max_sequence_length: the widest row ``S`` (the tiny GPT's positions).
        lr: Adam learning rate."""

    def __init__(
        self,
        model: TinyGPTSpec | HFModelSpec | None = None,
        vocab_size: int = 16,
        max_sequence_length: int = 16,
        lr: float = 3e-3,
    ) -> None:
        super().__init__(loss_fn=NLLLossFn())
        self.model_spec = replace(model) if model is not None else TinyGPTSpec()
        self.policy = RecipeModel(self.model_spec, vocab_size, max_sequence_length)
        self.lr = lr
        self.save_hyperparameters(
            {
                "model": asdict(self.model_spec),
                "vocab_size": vocab_size,
                "max_sequence_length": max_sequence_length,
                "lr": lr,
            }
        )

    def setup(self, stage: str) -> None:
        """When fitting: ``micro_batch_size`` divides the rank's ``samples_per_step / DP`` rows."""
        if stage == "fit":
            check_step_microbatches(self, "samples_per_step")

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Every rank agrees that each has the SFT keys and rows within the model's length."""
        size = self.policy.max_sequence_length
        agree_on_batch(self, lambda: check_rows(type(self).__name__, batch, SFT_KEYS, size))

    def training_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """One optimizer step of the token-mean NLL over the global batch."""
        # NLLLossFn: the mean over every response token of the global batch, whatever the
        # TP/PP/DP layout, microbatch split, packing or token budget
        self.check_batch(batch)
        return self.forward_backward(batch).as_step_result()

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int = 0) -> dict[str, Any]:
        """The held-out NLL (``val_loss``), forward-only."""
        self.check_batch(batch)
        return self.forward_backward(batch, forward_only=True).as_step_result()
