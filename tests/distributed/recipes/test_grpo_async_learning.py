"""Asynchronous GRPO learns the counting task as fast as synchronous GRPO, within 20%: with
``RolloutSpec(max_staleness=1)`` (each batch sampled by the previous step's weights) and the
loss's truncated importance-sampling correction, the 5-step mean reward reaches 0.9 in at most
1.2x the steps of the synchronous run (DP=2, the embedded sampler, lr 2e-3)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.losses import ClippedPGLossConfig
from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule, RolloutSpec
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import run_on_ranks

STEPS = 50  # the bound, 1.2 x 41, is step 49
TIS = ClippedPGLossConfig(
    reference_policy_kl_penalty=0.0,
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=2.0,
)


class _Rows(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fits(rank: int) -> dict[str, list[dict[str, float]]]:
    """The synchronous run and the one-step-stale run with TIS, one after the other."""
    runs = {}
    for name, staleness, loss in (("sync", 0, None), ("async", 1, TIS)):
        rows = _Rows()
        trainer = cpu_trainer(
            strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=16)),
            max_steps=STEPS,
            gradient_clip_val=1.0,
            callbacks=[rows],
        )
        rollout = RolloutSpec(max_staleness=staleness)
        module = GRPOModule(rollout=rollout, loss=loss, lr=2e-3)
        trainer.fit(module, datamodule=PromptDataModule(num_steps=STEPS))
        runs[name] = rows.rows
    return runs


def _reach(rewards: list[float], window: int = 5) -> int | None:
    """The first step count after which the mean reward of the last ``window`` steps is >=
    0.9."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= 0.9:
            return end
    return None


@pytest.mark.timeout(240)  # two 50-step fits on DP=2: 40-60 s on 2 idle cores
def test_one_step_stale_grpo_reaches_the_reward_in_at_most_1_2x_the_steps():
    """Measured (2-core AMD EPYC; rollout seeds 1234, 1, 2, each with torch's default and its
    AVX2 kernels): synchronous 41 steps in all six, asynchronous with TIS 42-46 (ratio <= 1.12;
    without the correction 44-52, up to 1.27)."""
    runs, _ = run_on_ranks(_fits, 2, timeout=230)
    sync = [row["reward"] for row in runs["sync"]]
    stale = [row["reward"] for row in runs["async"]]
    assert [row["rollout_staleness"] for row in runs["async"]] == [0.0] + [1.0] * (STEPS - 1)
    assert "rollout_staleness" not in runs["sync"][0]
    steps_sync, steps_async = _reach(sync), _reach(stale)
    print(f"5-step mean reward >= 0.9 after {steps_sync} (sync) and {steps_async} (async) steps")
    assert steps_sync is not None and steps_async is not None, (sync, stale)
    assert steps_async <= 1.2 * steps_sync, (steps_sync, steps_async)
