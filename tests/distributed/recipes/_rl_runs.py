"""Rank functions of the GRPO-estimator and PPO recipe tests: fit a recipe under a ``Trainer``
with ``MCoreRLStrategy`` on the counting task and record every step's logged metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossConfig
from lightning_mcore_rl.recipes import GRPOModule, PPOModule, PromptDataModule
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import destroy_megatron_state


@dataclass(frozen=True)
class Recipe:
    """One run: ``ppo`` or GRPO with ``options`` (``GRPOModule``/``PPOModule`` keyword
    arguments), a reference KL ``kl`` (in the reward with ``kl_in_reward``), TP size, steps,
    gradient clipping."""

    ppo: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    kl: float = 0.0
    kl_in_reward: bool = False
    tp: int = 1
    steps: int = 4
    clip: float | None = 1.0


@dataclass
class Fit:
    """Every step's logged metrics; the reference check's largest difference (or ``None``)."""

    rows: list[dict[str, float]] = field(default_factory=list)
    reference_diff: float | None = None


class _Record(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _module(recipe: Recipe) -> GRPOModule:
    loss = ClippedPGLossConfig(
        reference_policy_kl_penalty=recipe.kl, use_kl_in_reward=recipe.kl_in_reward
    )
    cls = PPOModule if recipe.ppo else GRPOModule
    return cls(loss=loss, **dict(recipe.options))


def fit(
    rank: int,
    recipe: Recipe,
    check_reference: bool = False,
    root: str | None = None,
    ckpt_path: str | None = None,
) -> Fit:
    """Fit ``recipe`` (16 prompts x 4 completions per step, 16-row microbatches); with
    ``check_reference``, afterwards compare the hosted frozen copy's logprobs of a fresh rollout
    with the recompute path's (initial weights swapped into the policy). With ``root``, a
    ``ModelCheckpoint`` saves every 2 steps into ``root``; ``ckpt_path`` resumes from one."""
    record = _Record()
    callbacks: list[Callback] = [record]
    if root is not None and ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        )
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=recipe.tp,
            microbatching=MicrobatchConfig(micro_batch_size=16),
        ),
        max_steps=recipe.steps,
        gradient_clip_val=recipe.clip,
        enable_checkpointing=root is not None and ckpt_path is None,
        callbacks=callbacks,
    )
    module = _module(recipe)
    data = PromptDataModule(num_steps=recipe.steps)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    out = Fit(rows=record.rows)
    if check_reference:
        prompts = next(iter(data.train_dataloader()))
        batch, _ = module.make_rollout(prompts)
        frozen = module.compute_logprobs(batch, teacher=True)
        with module.reference_weights():
            recomputed = module.compute_logprobs(batch)
        current = module.compute_logprobs(batch)
        assert not torch.equal(current, recomputed)  # the policy has moved away from it
        out.reference_diff = float((frozen - recomputed).abs().max())
    destroy_megatron_state()
    return out


def fits(rank: int, recipes: list[Recipe]) -> list[Fit]:
    """Several runs in one process group, one after the other."""
    return [fit(rank, recipe) for recipe in recipes]


RLOO = (("use_leave_one_out_baseline", True), ("normalize_rewards", False))
REINFORCE_PP = (("advantage_estimator", "reinforce_plus_plus"),)
FROZEN_COPY = (("reference_model", "frozen_copy"),)


def reference_paths(rank: int, steps: int) -> tuple[Fit, Fit]:
    """GRPO with a reference KL at TP=2: the recompute path's run, then the frozen copy's with
    the reference check."""
    recompute = fit(rank, Recipe(kl=0.05, tp=2, steps=steps))
    frozen = fit(rank, Recipe(kl=0.05, tp=2, steps=steps, options=FROZEN_COPY), True)
    return recompute, frozen


def resume(rank: int, recipe: Recipe, root: str) -> tuple[Fit, Fit]:
    """An uninterrupted run saving every 2 steps, then a new Trainer resumed from its step-2
    checkpoint."""
    full = fit(rank, recipe, root=root)
    resumed = fit(rank, recipe, root=root, ckpt_path=os.path.join(root, "step=2.ckpt"))
    return full, resumed


def ppo_rejections(rank: int, layouts: list[dict[str, Any]]) -> list[str]:
    """The ``ValueError`` message ``PPOModule`` raises under each ``MCoreRLStrategy(**layout)``
    (``""`` if it trains)."""
    messages = []
    for layout in layouts:
        trainer = cpu_trainer(
            strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=16), **layout),
            max_steps=1,
        )
        try:
            trainer.fit(PPOModule(), datamodule=PromptDataModule(num_steps=1))
            messages.append("")
        except ValueError as err:
            messages.append(str(err))
        destroy_megatron_state()
    return messages


def whiten_halves(rank: int, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """This rank's half of the rows whitened with the statistics of both ranks' rows."""
    import torch.distributed as dist

    from lightning_mcore_rl.algorithms import masked_whiten

    half = values.shape[0] // 2
    rows = slice(rank * half, (rank + 1) * half)
    return masked_whiten(values[rows], mask[rows], unbiased=True, group=dist.group.WORLD)
