"""Rank functions of the SFT and DPO recipe tests: each fits the recipe under a ``Trainer`` with
``MCoreRLStrategy`` on the tiny GPT and records every step's logged metrics (and the first batch
of rank 0, for the plain-torch reference)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.losses import DPOLossConfig
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.recipes import (
    CountingPreferenceDataset,
    CountingSFTDataset,
    DPOModule,
    PreferenceDataModule,
    RewardModelModule,
    SFTDataModule,
    SFTModule,
    collate_pairs,
)
from lightning_mcore_rl.rollout import ModularCountingTask
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state

CONFIGS = Path(__file__).parents[3] / "examples" / "configs"
BETA = 0.1
DATA_STEPS = 20
"""Every run's dataset holds this many steps' worth of rows (the same rows in the same order
whatever ``max_steps``)."""


@dataclass(frozen=True)
class Layout:
    """One run's megatron layout: ``tp`` (DP = world / TP) and whether rows are packed into
    token-budget microbatches (SFT) or packed with fixed-size microbatches (DPO: whole pairs)."""

    tp: int = 1
    packed: bool = False


@dataclass
class Fit:
    """Every step's logged metrics and rank 0's first batch."""

    rows: list[dict[str, float]] = field(default_factory=list)
    first_batch: dict[str, torch.Tensor] = field(default_factory=dict)


class _Record(Callback):
    def __init__(self) -> None:
        self.fit = Fit()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.fit.first_batch = {k: v.clone() for k, v in batch.items()}

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.fit.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _trainer(
    strategy: MCoreRLStrategy, steps: int, callbacks: list[Callback], root: str | None = None
) -> Trainer:
    return cpu_trainer(
        default_root_dir=root,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        enable_checkpointing=root is not None,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def _fit(
    module: MCoreRLModule, data: LightningDataModule, strategy: MCoreRLStrategy, steps: int
) -> Fit:
    record = _Record()
    _trainer(strategy, steps, [record]).fit(module, datamodule=data)
    destroy_megatron_state()
    return record.fit


# ---------------------------------------------------------------- SFT


def sft_strategy(layout: Layout) -> MCoreRLStrategy:
    """8-row microbatches, or packed rows in 48-token microbatches (rows are 9-16 tokens)."""
    if layout.packed:
        return MCoreRLStrategy(
            tensor_model_parallel_size=layout.tp,
            microbatching=MicrobatchConfig(sequence_packing=True, max_tokens_per_microbatch=48),
        )
    return MCoreRLStrategy(
        tensor_model_parallel_size=layout.tp, microbatching=MicrobatchConfig(micro_batch_size=8)
    )


def sft_fit(layout: Layout, steps: int) -> Fit:
    """``steps`` SFT steps of 16 rows (the default recipe: tiny GPT, V = 16, S = 16)."""
    data = SFTDataModule(num_steps=DATA_STEPS)
    return _fit(SFTModule(), data, sft_strategy(layout), steps)


def plain_nll(batch: dict[str, torch.Tensor]) -> float:
    """The SFT loss of ``batch`` on the initial weights in plain torch: a TP=1 forward of the
    tiny GPT (same seed: the same full weights), ``log_softmax`` + gather, the mean over response
    tokens ``token_mask[:, 1:] * sample_mask``."""
    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(), vocab_size=16, max_sequence_length=16, seed=0)
    ids = batch["input_ids"]
    width = ids.shape[1]
    positions = torch.arange(width).expand_as(ids)
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(ids, positions, causal).float()  # [B, S, V]
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    destroy_megatron_state()
    return float(-(logprobs * mask).sum() / mask.sum())


def sft_single_rank(rank: int, steps: int) -> tuple[Fit, float]:
    """The TP=1 run and the plain-torch loss of its first batch."""
    fit = sft_fit(Layout(), steps)
    return fit, plain_nll(fit.first_batch)


def sft_layouts(rank: int, steps: int) -> dict[str, Fit]:
    """TP=2, DP=2, and DP=2 with packed token-budget microbatches."""
    layouts = {"tp2": Layout(tp=2), "dp2": Layout(), "dp2_packed": Layout(packed=True)}
    return {name: sft_fit(layout, steps) for name, layout in layouts.items()}


# ---------------------------------------------------------------- DPO


def dpo_fit(layout: Layout, steps: int, micro_batch_size: int = 8) -> Fit:
    """``steps`` DPO steps of 8 pairs (beta = 0.1), 8-row microbatches (packed: THD rows)."""
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=layout.tp,
        microbatching=MicrobatchConfig(
            sequence_packing=layout.packed, micro_batch_size=micro_batch_size
        ),
    )
    module = DPOModule(loss=DPOLossConfig(reference_policy_kl_penalty=BETA))
    return _fit(module, PreferenceDataModule(num_steps=DATA_STEPS), strategy, steps)


def _error(run: Any) -> str:
    """``"<type>: <message>"`` of the ``ValueError``/``TypeError`` ``run()`` raises."""
    try:
        run()
    except (ValueError, TypeError) as err:
        destroy_megatron_state()
        return f"{type(err).__name__}: {err}"
    return "no error"


def _odd_rows_fit(odd_rank: int = 0) -> None:
    """DPO on a batch that lost its last row on data-parallel rank ``odd_rank`` (7 rows: 3 pairs
    and a chosen row) and is whole on the others."""

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = collate_pairs(items)
        if int(os.environ["RANK"]) != odd_rank:
            return batch
        return {key: value[:-1] for key, value in batch.items()}

    dataset = CountingPreferenceDataset(ModularCountingTask(), 8, max_new_tokens=8)
    loader = DataLoader(dataset, batch_size=4, collate_fn=collate)
    _trainer(MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=8)), 1, []).fit(
        DPOModule(), loader
    )


def dpo_single_rank(rank: int, steps: int) -> tuple[Fit, dict[str, str]]:
    """The TP=1 run, and the errors of a batch with an odd row count and of an odd
    ``micro_batch_size`` (raised through the Trainer)."""
    fit = dpo_fit(Layout(), steps)
    errors = {
        "odd_rows": _error(_odd_rows_fit),
        "odd_micro_batch": _error(lambda: dpo_fit(Layout(), 1, micro_batch_size=3)),
    }
    return fit, errors


def dpo_layouts(rank: int, steps: int) -> tuple[dict[str, Fit], str]:
    """TP=2, and DP=2 with packed microbatches; the error of each rank when rank 1's batch has
    an odd row count (DP=2)."""
    fits = {
        "tp2": dpo_fit(Layout(tp=2), steps),
        "dp2_packed": dpo_fit(Layout(packed=True), steps),
    }
    return fits, _error(lambda: _odd_rows_fit(odd_rank=1))


# ---------------------------------------------------------------- reward model


class _Hidden(torch.nn.Module):
    """A stand-in LM head that returns the final hidden states ``[S, B, H]`` themselves."""

    def forward(self, hidden: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden, None


def plain_bradley_terry(batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The reward model's step-0 loss and accuracy on ``batch`` in plain torch: the TP=1 tiny GPT's
    final hidden states ``h`` (same seed), the score ``s = h[last real token] . w`` with ``w``
    the seed's ``output_layer.weight [1, H]``, ``mean(-log sigmoid(s_c - s_r))`` over the pairs
    and the fraction with ``s_c > s_r``."""
    from lightning_mcore_rl.models.tiny_gpt import full_parameter_value

    init_megatron_state()
    model = tiny_gpt(tiny_gpt_config(), vocab_size=16, max_sequence_length=16, seed=0)
    model.output_layer = _Hidden()
    ids = batch["input_ids"]
    width = ids.shape[1]
    positions = torch.arange(width).expand_as(ids)
    causal = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        hidden = model(ids, positions, causal).float()  # [B, S, H]
    weight = full_parameter_value("output_layer.weight", torch.Size([1, hidden.shape[-1]]), 0)
    last = hidden[torch.arange(ids.shape[0]), batch["input_lengths"] - 1]  # [B, H]
    scores = (last @ weight.t()).squeeze(-1)  # [B]
    margin = scores[::2] - scores[1::2]
    destroy_megatron_state()
    return float(-torch.nn.functional.logsigmoid(margin).mean()), float((margin > 0).float().mean())


def rm_fit(layout: Layout, steps: int, pp: int = 1, packed: bool = False) -> Fit:
    """``steps`` reward-model steps of 16 demonstration-vs-random pairs, 4-row microbatches."""
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=pp,
        microbatching=MicrobatchConfig(sequence_packing=packed, micro_batch_size=4),
    )
    data = PreferenceDataModule(pairs_per_step=16, num_steps=DATA_STEPS, chosen_demonstration=True)
    return _fit(RewardModelModule(), data, strategy, steps)


def rm_single_rank(rank: int, steps: int) -> tuple[Fit, tuple[float, float], str]:
    """The TP=1 run, the plain-torch loss/accuracy of its first batch, the packing error."""
    fit = rm_fit(Layout(), steps)
    return (
        fit,
        plain_bradley_terry(fit.first_batch),
        _error(lambda: rm_fit(Layout(), 1, packed=True)),
    )


def rm_layouts(rank: int, steps: int) -> dict[str, Fit]:
    """TP=2 and PP=2 (1F1B over 4 microbatches)."""
    return {"tp2": rm_fit(Layout(tp=2), steps), "pp2": rm_fit(Layout(), steps, pp=2)}


# ---------------------------------------------------------------- Hugging Face models


def build_hf_llama(directory: str, seed: int = 0, tied: bool = False) -> None:
    """Save a random fp32 Llama (2 layers, H = 64, V = 16: the toy task's ids; ``tied``: input and
    output embeddings tied) in ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=16,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)


def hf_recipes(rank: int, hf_dir: str, steps: int) -> dict[str, Fit]:
    """SFT, DPO and the reward model of the HF model at TP=2 (``HFModelSpec``)."""
    from lightning_mcore_rl.recipes import HFModelSpec

    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=8)
    )
    sft = _fit(SFTModule(HFModelSpec(hf_dir)), SFTDataModule(num_steps=DATA_STEPS), strategy, steps)
    module = DPOModule(HFModelSpec(hf_dir), loss=DPOLossConfig(reference_policy_kl_penalty=BETA))
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=8)
    )
    dpo = _fit(module, PreferenceDataModule(num_steps=DATA_STEPS), strategy, steps)
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=4)
    )
    pairs = PreferenceDataModule(pairs_per_step=8, num_steps=DATA_STEPS, chosen_demonstration=True)
    rm = _fit(RewardModelModule(HFModelSpec(hf_dir)), pairs, strategy, steps)
    return {"sft": sft, "dpo": dpo, "rm": rm}


def hf_tied_rm_pp2_error(rank: int, hf_dir: str) -> str:
    """The error of a reward model of a tied-embedding HF checkpoint at PP=2."""
    from lightning_mcore_rl.recipes import HFModelSpec

    strategy = MCoreRLStrategy(
        pipeline_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=4)
    )
    pairs = PreferenceDataModule(pairs_per_step=8, num_steps=DATA_STEPS, chosen_demonstration=True)
    return _error(lambda: _fit(RewardModelModule(HFModelSpec(hf_dir)), pairs, strategy, 1))


# ---------------------------------------------------------------- resume


def _recipe(name: str) -> tuple[MCoreRLModule, LightningDataModule]:
    if name == "sft":
        return SFTModule(), SFTDataModule(num_steps=DATA_STEPS)
    if name == "dpo":
        return DPOModule(), PreferenceDataModule(num_steps=DATA_STEPS)
    data = PreferenceDataModule(pairs_per_step=16, num_steps=DATA_STEPS, chosen_demonstration=True)
    return RewardModelModule(), data


def resume_runs(rank: int, root: str, names: list[str], steps: int) -> dict[str, tuple[Fit, Fit]]:
    """Per recipe at TP=2: ``steps`` steps saving a checkpoint every 2, then a new Trainer
    resumed from ``step=2.ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out: dict[str, tuple[Fit, Fit]] = {}
    for name in names:
        fits = []
        for ckpt in (None, f"{root}/{name}/step=2.ckpt"):
            record = _Record()
            callbacks: list[Callback] = [record]
            if ckpt is None:
                callbacks.append(
                    ModelCheckpoint(
                        dirpath=f"{root}/{name}",
                        filename="{step}",
                        every_n_train_steps=2,
                        save_top_k=-1,
                    )
                )
            strategy = MCoreRLStrategy(
                tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=4)
            )
            trainer = _trainer(strategy, steps, callbacks, root=f"{root}/{name}")
            trainer.fit(*_recipe(name), ckpt_path=ckpt)
            destroy_megatron_state()
            fits.append(record.fit)
        out[name] = (fits[0], fits[1])
    return out


# ---------------------------------------------------------------- validation


def _validate(module: MCoreRLModule, data: LightningDataModule) -> dict[str, float]:
    trainer = _trainer(MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=8)), 1, [])
    trainer.validate(module, datamodule=data, verbose=False)
    destroy_megatron_state()
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def validate_initial(rank: int) -> dict[str, tuple[dict[str, float], tuple[float, float]]]:
    """``Trainer.validate`` of each recipe's initial model on one held-out global batch (DP=2:
    half on each rank), and the plain-torch loss (and, for the reward model, accuracy) of the
    whole held-out set."""
    task = ModularCountingTask()
    sft_rows = CountingSFTDataset(task, 16, max_new_tokens=8, seed=1).rows
    pairs = CountingPreferenceDataset(task, 16, 8, seed=1, chosen_demonstration=True)
    rm_batch = collate_pairs([pairs[i] for i in range(len(pairs))])
    return {
        "sft": (_validate(SFTModule(), SFTDataModule(val_samples=16)), (plain_nll(sft_rows), 0.0)),
        "dpo": (_validate(DPOModule(), PreferenceDataModule(val_pairs=8)), (math.log(2), 0.0)),
        "rm": (
            _validate(
                RewardModelModule(),
                PreferenceDataModule(pairs_per_step=16, val_pairs=16, chosen_demonstration=True),
            ),
            plain_bradley_terry(rm_batch),
        ),
    }


# ---------------------------------------------------------------- lmrl fit


def lmrl_fit(rank: int, root: str, names: list[str], steps: int) -> dict[str, list[str]]:
    """``lmrl fit --config examples/configs/<name>.yaml --trainer.max_steps <steps>`` for each
    name, in ``root``; returns the lines of each run's ``outputs/<name>/metrics.csv`` (written by
    rank 0's ``MetricsHistory``: empty on the other ranks)."""
    from lightning_mcore_rl.cli import main

    os.chdir(root)
    out: dict[str, list[str]] = {}
    for name in names:
        config = CONFIGS / f"{name}.yaml"
        args = ["fit", "--config", str(config), f"--trainer.max_steps={steps}"]
        main([*args, "--trainer.enable_progress_bar=false"])
        destroy_megatron_state()
        history = Path(root) / "outputs" / name / "metrics.csv"
        out[name] = history.read_text().splitlines() if rank == 0 else []
    return out
