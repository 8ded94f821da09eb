"""Rank functions of the text-rollout tests: the Hugging Face source on left-padded prompts with
a stop token, and the GRPO recipe on a text task (``TextRewardTask``, ``PromptFileDataModule``)
under a Trainer with ``backend="hf"``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _hf_ranks import _COMMON, randomize
from _rollout_ranks import _RecordingGRPO, _Rows
from helpers.trainer import cpu_trainer
from helpers.unit import word_level_tokenizer

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import (
    HFModelSpec,
    PromptFileDataModule,
    RolloutSpec,
    TextRewardTask,
)
from lightning_mcore_rl.rollout import HFRolloutSource, SamplingConfig
from lightning_mcore_rl.strategy import MicrobatchConfig

WORDS = ["<unk>", "<pad>", "<s>", "</s>", *"123456789", "a", "b", "c"]
"""16 words, the model's whole vocabulary, so ``</s>`` (id 3) is drawn often enough to stop."""
EOS, PAD = 3, 1
PROMPTS = ["a b 1", "c", "a 2 3 4 b", "b b", "1 2", "c c c", "a", "4 5 6 7"]
"""Prompts of 1 to 5 words (left-padded to the longest of a batch)."""


def write_text_model(directory: Path, seed: int) -> None:
    """A random fp32 Llama over the 16 :data:`WORDS` with its tokenizer, and ``prompts.jsonl``
    (one row per :data:`PROMPTS` entry, its ``answer`` the word count)."""
    import transformers

    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": len(WORDS)})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    word_level_tokenizer(WORDS, chat_template="").save_pretrained(directory)
    rows = [{"prompt": p, "answer": str(len(p.split()))} for p in PROMPTS]
    (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def digit_reward(
    prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """The fraction of a completion's words that are digits (varies within a group, so the
    advantages and the gradient are non-zero)."""
    scores = []
    for text in completions:
        words = text.split()
        scores.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return torch.tensor(scores, dtype=torch.float32)


def padded_source(rank: int, hf_dir: str) -> dict[str, Any]:
    """One ``HFRolloutSource.generate`` of all :data:`PROMPTS` left-padded, stopping at EOS."""
    tokenizer = word_level_tokenizer(WORDS, chat_template="")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(map(len, ids))
    prompts = torch.full((len(ids), width), PAD, dtype=torch.long)
    for row, tokens in enumerate(ids):
        prompts[row, width - len(tokens) :] = torch.tensor(tokens)
    lengths = torch.tensor([len(t) for t in ids])
    source = HFRolloutSource(hf_dir, dist.group.WORLD)
    sampling = SamplingConfig(8, temperature=1.2, seed=5, stop_token_ids=(EOS,), pad_token_id=PAD)
    return {"rollout": source.generate(prompts, sampling, lengths), "prompt_ids": ids}


class _TextGRPO(_RecordingGRPO):
    """Also keeps each step's training rows (``input_ids``, ``input_lengths``, ``token_mask``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batches: list[dict[str, torch.Tensor]] = []

    def forward_backward(self, batch: Any, forward_only: bool = False) -> Any:
        keys = ("input_ids", "input_lengths", "token_mask")
        self.batches.append({k: batch[k].clone() for k in keys})
        return super().forward_backward(batch, forward_only)


def text_grpo_run(rank: int, hf_dir: str, tp: int, steps: int) -> dict[str, Any]:
    """GRPO on the text task (the digit reward, EOS stops) with ``backend="hf"`` at TP=``tp``
    (DP = 2 / TP): ``steps`` steps of 4 prompts x 2 completions."""
    rows = _Rows()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp, microbatching=MicrobatchConfig(micro_batch_size=4)
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[rows],
    )
    module = _TextGRPO(
        task=TextRewardTask(reward=digit_reward, max_prompt_length=5),
        model=HFModelSpec(path=hf_dir),
        rollout=RolloutSpec(group_size=2, max_new_tokens=6, temperature=1.2, backend="hf"),
        lr=1e-2,
    )
    data = PromptFileDataModule(
        train_files=str(Path(hf_dir) / "prompts.jsonl"),
        tokenizer=hf_dir,
        max_prompt_length=5,
        prompts_per_step=4,
    )
    trainer.fit(module, datamodule=data)
    return {"rows": rows.rows, "max_errors": module.max_errors, "batches": module.batches}
