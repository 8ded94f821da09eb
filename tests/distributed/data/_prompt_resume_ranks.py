"""Prompt files, a tiny word-level tokenizer and the rank function of the prompt-data resume test
(also used by ``tests/unit/recipes/test_prompt_data.py``).

The tokenizer is built locally with ``tokenizers`` (no download): one id per whitespace word, BOS
added by its post-processor, and a chat template that starts with the BOS itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from helpers.trainer import cpu_trainer
from helpers.unit import word_level_tokenizer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.recipes.prompt_data import PromptBatch, PromptFileDataModule
from lightning_mcore_rl.strategy import MicrobatchConfig

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<system>", "<user>", "<assistant>"]
WORDS = [*SPECIALS, "what", "is", "plus", "be", "brief", *(str(n) for n in range(20))]
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
LONG_PROMPT = "what is " + " plus ".join(["1"] * 6)  # 13 words: 14 tokens with the BOS


def tiny_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` (``<s>`` prepended, pad ``<pad>`` = 1)."""
    return word_level_tokenizer(WORDS, CHAT_TEMPLATE, prepend_bos=True)


def ids(text: str) -> list[int]:
    """The ids of whitespace-separated :data:`WORDS` (no BOS): the expected tokenization."""
    return [WORDS.index(word) for word in text.split()]


def addition_rows(num_rows: int, long_every: int = 0) -> list[dict[str, Any]]:
    """Rows ``{"prompt": "what is a plus b", "answer": a+b, "id": i}``; with ``long_every``,
    every ``long_every``-th row has :data:`LONG_PROMPT` (answer 6) instead."""
    rows = []
    for i in range(num_rows):
        a, b = i % 10, (3 * i) % 10
        long = long_every and i % long_every == long_every - 1
        prompt = LONG_PROMPT if long else f"what is {a} plus {b}"
        rows.append({"prompt": prompt, "answer": 6 if long else a + b, "id": i})
    return rows


def write_rows(rows: list[dict[str, Any]], path: Path) -> str:
    """Write ``rows`` as JSONL (``.jsonl``) or Parquet (``.parquet``, through ``datasets``)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


class PromptLM(MCoreRLModule):
    """A trivial module: records each step's prompt rows, then one LM step on the prompt ids (so
    the strategy's real step, optimizer and checkpoint run)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config

        groups = self.parallel_groups
        return tiny_gpt(tiny_gpt_config(groups), groups=groups, vocab_size=len(WORDS), seed=0,
                        vp_stage=vp_stage)  # fmt: skip

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)

    def training_step(self, batch: PromptBatch, batch_idx: int = 0) -> dict[str, Any]:  # type: ignore[override]
        self.seen.append(batch.indices.tolist())
        tokens = batch.input_ids
        out = self.forward_backward({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        return out.as_step_result()


@dataclass(frozen=True)
class ResumeRun:
    """One rank: the row ids per step of the uninterrupted and the resumed fit, and the data
    module's filtered count."""

    full: list[list[int]]
    resumed: list[list[int]]
    num_filtered: int
    dataset_size: int


def _fit(
    path: str, ckpt_dir: str, ckpt_path: str | None
) -> tuple[list[list[int]], PromptFileDataModule]:
    callbacks = []
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=3, save_top_k=-1
            )
        )
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=1)),
        max_steps=7,
        enable_checkpointing=ckpt_path is None,
        callbacks=callbacks,
    )
    data = PromptFileDataModule(
        path,
        tiny_tokenizer(),
        max_prompt_length=8,
        prompts_per_step=4,
        seed=3,
        cache_dir=f"{ckpt_dir}/../hf-cache",
    )
    module = PromptLM()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module.seen, data


def resume_rank(rank: int, path: str, ckpt_dir: str) -> ResumeRun:
    """Fit 7 steps (checkpoints at steps 3 and 6), then resume a new Trainer from step 3."""
    full, data = _fit(path, ckpt_dir, None)
    resumed, _ = _fit(path, ckpt_dir, f"{ckpt_dir}/step=3.ckpt")
    assert data.train_dataset is not None
    return ResumeRun(full, resumed, data.train_dataset.num_filtered, len(data.train_dataset))
