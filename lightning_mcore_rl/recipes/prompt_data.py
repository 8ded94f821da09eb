"""Prompt files for RL: JSONL/Parquet rows tokenized (optionally through a chat template),
filtered by length and served per data-parallel rank in `PromptBatch` form (``docs/data.md``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl.recipes.common import rank_train_loader, rank_val_loader
from lightning_mcore_rl.strategy import ResumableLoader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# A row holds a prompt field (a string, or a list of {"role", "content"} chat messages) and
# metadata fields that the reward functions read (e.g. "answer", `lightning_mcore_rl.rewards`).


@dataclass
class PromptBatch:
    """``b`` prompts of one data-parallel rank: ``input_ids [b, P]`` padded on ``padding_side``,
    ``input_lengths [b]``, the tokenized ``prompts`` texts, the rows' ``metadata`` and their
    ``indices [b]`` in the files (before filtering)."""

    input_ids: Tensor
    input_lengths: Tensor
    prompts: list[str]
    metadata: list[dict[str, Any]]
    indices: Tensor
    # left by default: every prompt ends at the last column, where sampling starts
    padding_side: Literal["left", "right"] = "left"


def read_prompt_files(files: str | Sequence[str], cache_dir: str | None = None) -> Any:
    """A ``datasets.Dataset`` of the rows of local JSONL (``.jsonl``/``.json``) or Parquet
    ``files`` (one format), in order, cached in ``cache_dir`` (``None``: the ``datasets`` default).

    Raises:
        FileNotFoundError: a file does not exist.
        ValueError: no files, an unknown suffix, or a mix of formats."""
    import datasets  # type: ignore[import-untyped]  # no py.typed marker

    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise ValueError("`files` is empty: give at least one JSONL or Parquet file.")
    formats = set()
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"Prompt file {path!r} does not exist.")
        suffix = Path(path).suffix.lower()
        if suffix not in _FORMATS:
            raise ValueError(
                f"Prompt file {path!r} has suffix {suffix!r}; expected one of {sorted(_FORMATS)}."
            )
        formats.add(_FORMATS[suffix])
    if len(formats) != 1:
        raise ValueError(f"`files` mixes formats {sorted(formats)}: give files of one format.")
    return datasets.load_dataset(
        formats.pop(), data_files=paths, split="train", cache_dir=cache_dir
    )


def render_prompt(
    prompt: Any,
    tokenizer: PreTrainedTokenizerBase,
    index: int,
    *,
    chat_template: bool,
    system_prompt: str | None = None,
) -> str:
    """The text the policy is given for row ``index``'s ``prompt`` field: the string itself, or
    with ``chat_template`` the messages rendered with the generation prompt.

    Raises:
        ValueError: the prompt is neither a string nor (with ``chat_template``) a message list."""
    if isinstance(prompt, str) and not chat_template:
        return prompt
    if not chat_template:
        raise ValueError(
            f"Row {index}: the prompt is a {type(prompt).__name__}; without `chat_template=True` "
            "it must be a string."
        )
    # a string becomes [system?, user] messages; a message list is used as it is
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
    elif isinstance(prompt, list) and all(
        isinstance(m, Mapping) and {"role", "content"} <= set(m) for m in prompt
    ):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(
            f"Row {index}: the prompt must be a string or a list of {{'role', 'content'}} "
            f"messages, got {prompt!r}."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)  # tokenize=False renders one conversation to one string
    return text


class PromptFileDataset(Dataset):
    """Tokenized prompts of JSONL/Parquet files, rows longer than ``max_prompt_length`` dropped
    (``num_filtered`` of ``num_rows``); arguments as `PromptFileDataModule`'s.

    Raises:
        ValueError: a missing field, no chat template, an empty prompt, or all filtered out."""

    def __init__(
        self,
        files: str | Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str = "prompt",
        metadata_keys: Sequence[str] | None = None,
        max_prompt_length: int | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length` must be >= 1 or None, got {max_prompt_length}.")
        if chat_template and tokenizer.chat_template is None:
            raise ValueError(
                "`chat_template=True` but the tokenizer has no chat template "
                "(`tokenizer.chat_template` is None)."
            )
        rows = read_prompt_files(files, cache_dir)
        columns = list(rows.column_names)
        keys = [k for k in columns if k != prompt_key] if metadata_keys is None else metadata_keys
        for key in [prompt_key, *keys]:
            if key not in columns:
                raise ValueError(
                    f"The prompt files have no field {key!r}; their fields: {columns}."
                )
        if rows.num_rows == 0:
            raise ValueError(f"The prompt files {files!r} hold no rows.")
        # every prompt rendered and tokenized once, in memory, here
        table = rows.select_columns([prompt_key, *keys]).to_dict()
        texts = [
            render_prompt(p, tokenizer, i, chat_template=chat_template, system_prompt=system_prompt)
            for i, p in enumerate(table[prompt_key])
        ]
        # a rendered chat template carries its special tokens; a plain prompt gets the
        # tokenizer's usual ones (e.g. BOS)
        encoded = tokenizer(texts, add_special_tokens=not chat_template)["input_ids"]
        self.num_rows = len(texts)
        self.max_prompt_length = max_prompt_length
        kept = [
            i
            for i, ids in enumerate(encoded)
            if max_prompt_length is None or len(ids) <= max_prompt_length
        ]
        self.num_filtered = self.num_rows - len(kept)
        if not kept:
            raise ValueError(
                f"All {self.num_rows} prompts are longer than max_prompt_length="
                f"{max_prompt_length} tokens (the shortest has {min(map(len, encoded))})."
            )
        empty = [i for i in kept if not encoded[i]]
        if empty:
            raise ValueError(f"Rows {empty[:5]} have prompts with no tokens.")
        self.indices = kept
        self.input_ids = [torch.tensor(encoded[i], dtype=torch.long) for i in kept]
        self.prompts = [texts[i] for i in kept]
        self.metadata = [{k: table[k][i] for k in keys} for i in kept]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """``{"input_ids": [P_i], "prompt": str, "metadata": dict, "index": int}``."""
        return {
            "input_ids": self.input_ids[index],
            "prompt": self.prompts[index],
            "metadata": self.metadata[index],
            "index": self.indices[index],
        }


def collate_prompts(
    items: Sequence[Mapping[str, Any]],
    pad_token_id: int,
    padding_side: Literal["left", "right"] = "left",
) -> PromptBatch:
    """Pad ``b`` `PromptFileDataset` items to the longest into one `PromptBatch`."""
    lengths = torch.tensor([len(item["input_ids"]) for item in items], dtype=torch.long)
    width = int(lengths.max()) if len(items) else 0
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)  # [b, P]
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        start = width - n if padding_side == "left" else 0
        input_ids[row, start : start + n] = item["input_ids"]
    return PromptBatch(
        input_ids=input_ids,
        input_lengths=lengths,
        prompts=[item["prompt"] for item in items],
        metadata=[dict(item["metadata"]) for item in items],
        indices=torch.tensor([item["index"] for item in items], dtype=torch.long),
        padding_side=padding_side,
    )


class PromptFileDataModule(LightningDataModule):
    """Prompts from JSONL/Parquet files, ``prompts_per_step`` per step in `PromptBatch` batches.

    Args:
        train_files: JSONL or Parquet files of the training prompts.
        tokenizer: a Hugging Face tokenizer or the directory ``AutoTokenizer`` loads it from.
        prompt_key: the prompt field.
        metadata_keys: the metadata fields (default: every field but the prompt).
        max_prompt_length: drop longer prompts (the count is logged on rank 0).
        chat_template: render prompts with the tokenizer's chat template.
        system_prompt: with ``chat_template``, a system message before string prompts.
        prompts_per_step: global prompts per optimizer step (divisible by DP).
        seed: the shuffling seed.
        val_files: held-out prompts (``None``: no validation loop); their count divisible by DP.
        padding_side: where the pad ids go.
        pad_token_id: the pad id (default: the tokenizer's).
        cache_dir: the ``datasets`` cache."""

    def __init__(
        self,
        train_files: str | list[str],
        tokenizer: str | PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        metadata_keys: list[str] | None = None,
        max_prompt_length: int | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        prompts_per_step: int = 16,
        seed: int = 0,
        val_files: str | list[str] | None = None,
        padding_side: Literal["left", "right"] = "left",
        pad_token_id: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if padding_side not in ("left", "right"):
            raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
        if prompts_per_step < 1:
            raise ValueError(f"`prompts_per_step` must be >= 1, got {prompts_per_step}.")
        self.train_files = train_files
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.metadata_keys = metadata_keys
        self.max_prompt_length = max_prompt_length
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.val_files = val_files
        self.padding_side = padding_side
        self.pad_token_id = pad_token_id
        self.cache_dir = cache_dir
        self.train_dataset: PromptFileDataset | None = None
        self.val_dataset: PromptFileDataset | None = None

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (a directory is loaded once, with ``AutoTokenizer``)."""
        if isinstance(self.tokenizer, str):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        return self.tokenizer

    def _dataset(self, files: str | list[str], split: str) -> PromptFileDataset:
        dataset = PromptFileDataset(
            files,
            self._tokenizer(),
            prompt_key=self.prompt_key,
            metadata_keys=self.metadata_keys,
            max_prompt_length=self.max_prompt_length,
            chat_template=self.chat_template,
            system_prompt=self.system_prompt,
            cache_dir=self.cache_dir,
        )
        if dataset.num_filtered:
            rank_zero_info(
                f"PromptFileDataModule: dropped {dataset.num_filtered} of {dataset.num_rows} "
                f"{split} prompts longer than max_prompt_length={self.max_prompt_length} tokens."
            )
        return dataset

    def setup(self, stage: str) -> None:
        """Read and tokenize the files (once per process; the filtered counts go to the log)."""
        # setup runs per stage: the datasets, once built, are kept
        if self.train_dataset is None:
            self.train_dataset = self._dataset(self.train_files, "train")
        if self.val_files is not None and self.val_dataset is None:
            self.val_dataset = self._dataset(self.val_files, "val")

    def _collate(self) -> functools.partial[PromptBatch]:
        pad = self.pad_token_id
        if pad is None:
            pad = self._tokenizer().pad_token_id
        if pad is None:
            raise ValueError(
                "The tokenizer has no pad token: pass `pad_token_id` (e.g. the EOS id); pad "
                "positions are outside `input_lengths` either way."
            )
        return functools.partial(collate_prompts, pad_token_id=pad, padding_side=self.padding_side)

    def train_dataloader(self) -> ResumableLoader:
        """This rank's batches (`PromptBatch`) of ``prompts_per_step / DP`` prompts.

        Raises:
            ValueError: ``prompts_per_step`` not divisible by DP, or too few prompts for a step."""
        assert self.trainer is not None and self.train_dataset is not None  # after setup()
        if len(self.train_dataset) < self.prompts_per_step:
            raise ValueError(
                f"{len(self.train_dataset)} training prompts (after filtering) are fewer than "
                f"`prompts_per_step` ({self.prompts_per_step}): an epoch would have no step."
            )
        # A ResumableLoader over a DistributedSampler on megatron's DP group (a replica's TP/PP/CP
        # ranks read the same prompts), reshuffled per epoch. The epoch's last partial step is
        # dropped, so every step has prompts_per_step prompts and fit(ckpt_path=...) mid-epoch
        # continues with the next unseen prompts.
        return rank_train_loader(
            self.trainer, self.train_dataset, self.prompts_per_step, "prompts_per_step",
            self.seed, collate_fn=self._collate(), drop_last=True,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The held-out prompts (none without ``val_files``) as batches (`PromptBatch`)."""
        if self.val_dataset is None:
            return []
        # split over DP in batches of prompts_per_step / DP
        return rank_val_loader(
            self.trainer, self.val_dataset, self.prompts_per_step, "val prompts", self._collate()
        )
