"""Rank functions of ``test_distillation_recipe``: the distillation recipe under a ``Trainer`` with
``MCoreRLStrategy`` on the tiny GPT (and a tiny Hugging Face Llama), every step's logged metrics
recorded."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback, Trainer

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import DistillationLossConfig
from lightning_mcore_rl.recipes import (
    DistillationModule,
    GRPOModule,
    HFModelSpec,
    PromptDataModule,
    RolloutSpec,
    TeacherSpec,
    TinyGPTSpec,
)
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state

SMALL_ROLLOUT = RolloutSpec(group_size=4, max_new_tokens=8)
OTHER_TEACHER = TinyGPTSpec(num_layers=1, hidden_size=32, num_attention_heads=4, seed=2)
"""A teacher of another size and seed than the default student (``H_t = 32`` vs ``H = 64``)."""


@dataclass(frozen=True)
class Variant:
    """One distillation fit: the module's signal options, the teacher, and the rollout seed (the
    student's sampling streams, training and validation)."""

    vocabulary: str = "topk"
    payload: str = "logits"
    kl_type: str = "mixed"
    tail: bool = False
    topk: int = 8
    teacher: TinyGPTSpec | HFModelSpec = field(default_factory=lambda: OTHER_TEACHER)
    student: TinyGPTSpec | HFModelSpec = field(default_factory=lambda: TinyGPTSpec(seed=1))
    checkpoint: str | None = None
    lr: float = 5e-3
    seed: int = SMALL_ROLLOUT.seed

    def module(self) -> DistillationModule:
        return DistillationModule(
            model=self.student,
            teacher=TeacherSpec(model=self.teacher, checkpoint=self.checkpoint),
            rollout=replace(SMALL_ROLLOUT, seed=self.seed),
            vocabulary=self.vocabulary,  # type: ignore[arg-type]
            topk=self.topk,
            topk_loss=DistillationLossConfig(
                kl_type=self.kl_type,  # type: ignore[arg-type]
                zero_outside_topk=self.tail,
            ),
            payload=self.payload,  # type: ignore[arg-type]
            lr=self.lr,
        )


@dataclass
class Fit:
    """Every step's logged metrics and the metrics after the fit (validation included)."""

    rows: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    layout: tuple[int, int, int] = (1, 1, 1)  # (TP, PP, DP)


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(
    module: Any,
    tp: int,
    steps: int,
    prompts: int,
    val_prompts: int = 0,
    mbs: int = 8,
    packing: bool = False,
    **layout: Any,
) -> tuple[Fit, Trainer]:
    record = _Record()
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=tp,
        microbatching=MicrobatchConfig(micro_batch_size=mbs, sequence_packing=packing),
        **layout,
    )
    trainer = cpu_trainer(
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        callbacks=[record],
    )
    data = PromptDataModule(prompts_per_step=prompts, num_steps=steps, val_prompts=val_prompts)
    trainer.fit(module, datamodule=data)
    groups = trainer.strategy.groups  # type: ignore[attr-defined]
    fit = Fit(
        rows=record.rows,
        final={k: float(v) for k, v in trainer.callback_metrics.items()},
        layout=(groups.tp_size, groups.pp_size, groups.dp_size),
    )
    return fit, trainer


def converge_rank(
    rank: int, directory: str, steps: dict[str, int], seed: int = SMALL_ROLLOUT.seed
) -> dict[str, Fit]:
    """Train the teacher with the GRPO recipe (``steps["grpo"]`` steps, the default tiny GPT,
    seed 0), save its checkpoint, then distil it into a seed-1 student with the full-vocabulary
    hidden-state loss and the top-k (K = 8, mixed KL + tail) loss; each distillation ends with a
    validation of 64 held-out prompts scoring the student and the teacher on the same seeds.
    ``seed`` is the rollout seed of all three fits (their sampling, hence their trajectories)."""
    grpo_module = GRPOModule(rollout=RolloutSpec(seed=seed))
    grpo, trainer = _fit(grpo_module, 1, steps["grpo"], 16, mbs=16)
    path = str(Path(directory) / f"grpo_teacher_{seed}.ckpt")
    trainer.save_checkpoint(path)
    destroy_megatron_state()
    teacher = TinyGPTSpec(seed=0)
    runs = {"grpo": grpo}
    variants = {
        "full": Variant(vocabulary="full", payload="hidden_states", teacher=teacher),
        "topk": Variant(tail=True, teacher=teacher),
    }
    for name, variant in variants.items():
        module = replace(variant, checkpoint=path, seed=seed).module()
        runs[name], _ = _fit(module, 1, steps[name], 16, val_prompts=64, mbs=16)
        destroy_megatron_state()
    return runs


def variants_rank(
    rank: int,
    tp: int,
    variants: dict[str, Variant],
    steps: int,
    packing: bool = False,
    **layout: Any,
) -> dict[str, Fit]:
    """``steps`` steps of every variant at TP = ``tp`` and the other ``MCoreRLStrategy``
    ``layout`` arguments (DP = world / TP / PP), 4 prompts x 4 samples per step, 8-row
    microbatches (``packing``: ``MicrobatchConfig(sequence_packing=True)``)."""
    runs = {}
    for name, variant in variants.items():
        runs[name], _ = _fit(variant.module(), tp, steps, 4, packing=packing, **layout)
        destroy_megatron_state()
    return runs


def packing_rank(rank: int, variants: dict[str, Variant], steps: int) -> tuple[dict, dict]:
    """Every variant padded, then packed (the student's loss and the teacher's signal on packed
    microbatches), on the same ranks."""
    padded = variants_rank(rank, 1, variants, steps)
    packed = variants_rank(rank, 1, variants, steps, packing=True)
    return padded, packed
