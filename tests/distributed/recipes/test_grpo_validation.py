"""The GRPO recipe's validation at DP=2 logs reward, pass@k and response-length metrics
(torchmetrics over the data-parallel group) equal to one computation on all ranks' samples."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.metrics import pass_at_k
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule, RolloutSpec
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import run_on_ranks

GROUP = 4
K = (1, 2, 4)


class _Scores(Callback):
    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.batches.append({k: v.clone() for k, v in outputs.items()})


def _validate(rank: int) -> tuple[dict[str, float], list[dict[str, torch.Tensor]]]:
    scores = _Scores()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=8)),
        callbacks=[scores],
    )
    # two-token completions: a random policy solves some of them, so pass@k is not trivially 0
    module = GRPOModule(rollout=RolloutSpec(group_size=GROUP, max_new_tokens=2), pass_at_k=K)
    data = PromptDataModule(prompts_per_step=8, val_prompts=16)
    trainer.validate(module, datamodule=data)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, scores.batches


def test_grpo_validation_metrics_equal_one_computation_on_all_samples():
    (logged, batches0), (logged1, batches1) = run_on_ranks(_validate, 2, timeout=120)
    assert logged == logged1  # identical on both DP ranks
    batches = batches0 + batches1
    assert len(batches) == 4  # 16 prompts / DP 2 / 4 per rank-batch
    rewards = torch.cat([b["rewards"] for b in batches]).double()
    correct = torch.cat([b["correct"].view(-1, GROUP) for b in batches])
    lengths = torch.cat([b["lengths"] for b in batches]).double()
    truncated = torch.cat([b["truncated"] for b in batches]).double()
    assert 0 < int(correct.sum()) < correct.numel()  # a non-degenerate check
    expected = {
        "val_reward": float(rewards.mean()),
        "val_reward_std": float(rewards.std(correction=0)),
        "val_response_length_mean": float(lengths.mean()),
        "val_response_length_max": float(lengths.max()),
        "val_truncated_fraction": float(truncated.mean()),
        **{f"val_pass@{k}": float(pass_at_k(GROUP, correct.sum(dim=1), k).mean()) for k in K},
    }
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, abs=1e-6), name
