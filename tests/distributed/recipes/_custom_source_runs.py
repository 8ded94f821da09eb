"""Rank function of ``test_custom_rollout_source``: GRPO and distillation under a ``Trainer``
with user rollout sources (deterministic, no model) passed as ``RolloutSpec(backend=...)`` and
``TeacherSpec(backend=...)``: what the sources built from and what reached the batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback
from torch import Tensor

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.recipes import (
    DistillationModule,
    GRPOModule,
    PromptDataModule,
    RolloutSpec,
    TeacherSpec,
)
from lightning_mcore_rl.rollout import Rollout, RolloutSetup, SamplingConfig

GROUP, NEW = 2, 3
LOGPROB = -0.5


class _Source:
    """Completion token ``j`` (from 1) of a row is ``next_token(last prompt token, j)``; logprob
    :data:`LOGPROB` on every completion token. Records the seeds it was asked for."""

    refit_required: ClassVar[bool] = False

    def __init__(self, setup: RolloutSetup | None = None) -> None:
        self.setup = setup
        self.seeds: list[int] = []

    @staticmethod
    def next_token(last: Tensor, j: int) -> Tensor:
        raise NotImplementedError

    def generate(
        self, prompts: Tensor, sampling: SamplingConfig, prompt_lengths: Tensor | None = None
    ) -> Rollout:
        self.seeds.append(sampling.seed)
        batch, width = prompts.shape
        last = prompts[:, -1]
        completion = torch.stack(
            [self.next_token(last, j) for j in range(1, sampling.max_new_tokens + 1)], dim=1
        )
        mask = torch.cat([torch.zeros(batch, width), torch.ones(completion.shape)], 1).long()
        tokens = torch.cat([prompts, completion], dim=1)
        return Rollout(tokens, mask, LOGPROB * mask.float(), torch.full((batch,), width))

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        raise AssertionError("refit_required is False: never refit")


class CountingSource(_Source):
    """Counts on from the prompt: the counting task's reward is 1."""

    @staticmethod
    def next_token(last: Tensor, j: int) -> Tensor:
        return (last + j) % 16


class RepeatingSource(_Source):
    """Repeats the prompt's last token: the counting task's reward is 0."""

    @staticmethod
    def next_token(last: Tensor, j: int) -> Tensor:
        return last


class _Record(Callback):
    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rewards.append(float(trainer.callback_metrics["reward"]))


def _fit(module: Any, val_prompts: int) -> tuple[_Record, Any]:
    record = _Record()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(), max_steps=2, num_sanity_val_steps=0, callbacks=[record]
    )
    data = PromptDataModule(prompts_per_step=4, num_steps=2, val_prompts=val_prompts)
    trainer.fit(module, datamodule=data)
    return record, trainer


def custom_sources_rank(rank: int) -> dict[str, Any]:
    """GRPO with a factory, distillation with a source class (student) and an instance
    (teacher); every step's first training batch is kept."""
    made: list[RolloutSetup] = []

    def factory(setup: RolloutSetup) -> CountingSource:
        made.append(setup)
        return CountingSource(setup)

    grpo = GRPOModule(rollout=RolloutSpec(group_size=GROUP, max_new_tokens=NEW, backend=factory))
    batches: list[dict[str, Tensor]] = []
    original = grpo.make_rollout

    def make_rollout(prompts: Tensor) -> Any:
        data, rewards = original(prompts)
        batches.append({"prompts": prompts, **{k: data[k] for k in data}})
        return data, rewards

    grpo.make_rollout = make_rollout  # type: ignore[method-assign]
    grpo_record, trainer = _fit(grpo, val_prompts=0)
    source = grpo.rollout_source.source
    assert isinstance(source, CountingSource)
    grpo_out = {
        "setups": len(made),
        "setup_is_the_strategy's": made[0].chunks is trainer.strategy.model_chunks
        and made[0].groups is trainer.strategy.groups,
        "dp_size": made[0].groups.dp_size,
        "seeds": source.seeds,
        "batches": batches,
        "rewards": grpo_record.rewards,
    }
    teacher = CountingSource()
    distillation = DistillationModule(
        rollout=RolloutSpec(group_size=GROUP, max_new_tokens=NEW, backend=RepeatingSource),
        teacher=TeacherSpec(backend=teacher),
    )
    record, trainer = _fit(distillation, val_prompts=4)
    student = distillation.rollout_source.source
    assert isinstance(student, RepeatingSource)
    metrics = trainer.callback_metrics
    return {
        "grpo": grpo_out,
        "student_calls": len(student.seeds),
        "teacher_calls": len(teacher.seeds),
        "teacher_is_the_instance": distillation.teacher_rollout.source is teacher,
        "rewards": record.rewards,
        "val_reward": float(metrics["val_reward"]),
        "val_teacher_reward": float(metrics["val_teacher_reward"]),
    }
