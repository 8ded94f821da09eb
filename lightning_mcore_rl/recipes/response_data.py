"""Prompt/response files for SFT: JSONL/Parquet rows ``{"prompt", "response"}`` tokenized with a
Hugging Face tokenizer and served per data-parallel rank as `SFTModule` batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl.recipes.common import rank_train_loader, rank_val_loader
from lightning_mcore_rl.recipes.prompt_data import read_prompt_files
from lightning_mcore_rl.strategy import ResumableLoader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ResponseFileDataset(Dataset):
    """Tokenized prompt/response rows right-padded to the widest row ``S`` (items: `__getitem__`);
    arguments as `ResponseFileDataModule`'s.

    Raises:
        ValueError: a missing field, no rows, a non-string or empty field, no EOS or pad token."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str = "prompt",
        response_key: str = "response",
        cache_dir: str | None = None,
    ) -> None:
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        if eos is None or pad is None:
            raise ValueError(
                f"The tokenizer needs an EOS and a pad token (eos_token_id={eos}, "
                f"pad_token_id={pad})."
            )
        rows = read_prompt_files(files, cache_dir)
        columns = list(rows.column_names)
        for key in (prompt_key, response_key):
            if key not in columns:
                raise ValueError(f"The files have no field {key!r}; their fields: {columns}.")
        if rows.num_rows == 0:
            raise ValueError(f"The files {files!r} hold no rows.")
        table = rows.select_columns([prompt_key, response_key]).to_dict()
        prompts, responses = table[prompt_key], table[response_key]
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            if not (isinstance(prompt, str) and isinstance(response, str)):
                raise ValueError(
                    f"Row {i}: `{prompt_key}` and `{response_key}` must be strings, got "
                    f"{type(prompt).__name__} and {type(response).__name__}."
                )
        # A row is the prompt's tokens with the tokenizer's special tokens (e.g. BOS, as
        # PromptFileDataset tokenizes GRPO prompts), then the response's without any, then EOS;
        # the loss is on the response and EOS only.
        prompt_ids = tokenizer(prompts)["input_ids"]
        response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
        empty = [i for i, ids in enumerate(response_ids) if not ids]
        if empty:
            raise ValueError(f"Rows {empty[:5]} have responses with no tokens.")
        # + 1: the EOS
        lengths = [len(p) + len(r) + 1 for p, r in zip(prompt_ids, response_ids, strict=True)]
        # the widest row of the files: every batch of every rank has the same width
        width = max(lengths)
        n = len(lengths)
        self.input_ids = torch.full((n, width), pad, dtype=torch.long)  # [n, S]
        self.token_mask = torch.zeros(n, width)  # [n, S]
        for row, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            self.input_ids[row, : lengths[row]] = torch.tensor([*p, *r, eos])
            self.token_mask[row, len(p) : lengths[row]] = 1.0
        self.input_lengths = torch.tensor(lengths, dtype=torch.long)  # [n]

    def __len__(self) -> int:
        return len(self.input_lengths)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """Row ``index``: ``input_ids``, ``token_mask`` (response and EOS) ``[S]``, and scalars."""
        return {
            "input_ids": self.input_ids[index],
            "input_lengths": self.input_lengths[index],
            "token_mask": self.token_mask[index],
            "sample_mask": torch.tensor(1.0),
        }


class ResponseFileDataModule(LightningDataModule):
    """Prompt/response files for `SFTModule`: ``samples_per_step`` rows per step in ``[b, S]``.

    Args:
        train_files: JSONL or Parquet files of ``{"prompt", "response"}`` rows.
        tokenizer: a Hugging Face tokenizer or the directory ``AutoTokenizer`` loads it from.
        prompt_key: the prompt field.
        response_key: the response field.
        samples_per_step: global rows per optimizer step (divisible by DP).
        seed: the shuffling seed.
        val_files: held-out rows (``None``: no validation loop; their count divisible by DP).
        cache_dir: the ``datasets`` cache."""

    def __init__(
        self,
        train_files: str | list[str],
        tokenizer: str | PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        response_key: str = "response",
        samples_per_step: int = 16,
        seed: int = 0,
        val_files: str | list[str] | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if samples_per_step < 1:
            raise ValueError(f"`samples_per_step` must be >= 1, got {samples_per_step}.")
        self.train_files = train_files
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.response_key = response_key
        self.samples_per_step = samples_per_step
        self.seed = seed
        self.val_files = val_files
        self.cache_dir = cache_dir
        self.train_dataset: ResponseFileDataset | None = None
        self.val_dataset: ResponseFileDataset | None = None

    def _dataset(self, files: str | list[str]) -> ResponseFileDataset:
        tokenizer = self.tokenizer
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return ResponseFileDataset(
            files,
            tokenizer,
            prompt_key=self.prompt_key,
            response_key=self.response_key,
            cache_dir=self.cache_dir,
        )

    def setup(self, stage: str) -> None:
        """Read and tokenize the files (once per process)."""
        if self.train_dataset is None:
            self.train_dataset = self._dataset(self.train_files)
        if self.val_files is not None and self.val_dataset is None:
            self.val_dataset = self._dataset(self.val_files)

    def train_dataloader(self) -> ResumableLoader:
        """This rank's ``samples_per_step / DP`` rows per step (resumable mid-epoch).

        Raises:
            ValueError: ``samples_per_step`` not divisible by DP, or fewer rows than one step."""
        assert self.train_dataset is not None  # after setup()
        if len(self.train_dataset) < self.samples_per_step:
            raise ValueError(
                f"{len(self.train_dataset)} training rows are fewer than `samples_per_step` "
                f"({self.samples_per_step}): an epoch would have no step."
            )
        # shuffled with seed, reshuffled per epoch, the epoch's last partial step dropped; a
        # replica's TP/PP/CP ranks read the same rows
        return rank_train_loader(
            self.trainer, self.train_dataset, self.samples_per_step, "samples_per_step",
            self.seed, drop_last=True,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The held-out rows (none without ``val_files``), split over data-parallel ranks."""
        if self.val_dataset is None:
            return []
        return rank_val_loader(self.trainer, self.val_dataset, self.samples_per_step, "val rows")
