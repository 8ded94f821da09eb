"""GRPO's reference policy as a hosted frozen copy (= the recompute path at TP=2) and its RLOO /
REINFORCE++ (KL in the reward) advantages under a Trainer: the reward rises."""

from __future__ import annotations

import pytest
from _rl_runs import REINFORCE_PP, RLOO, Recipe, fits, reference_paths

from lightning_mcore_rl.testing import run_on_ranks

STEPS = 3
RISE = 0.1


def test_frozen_copy_reference_equals_the_recompute_path_at_tp2():
    # two TP=2 runs with beta = 0.05: the reference swapped in from the seed vs a hosted frozen
    # copy; then, on the frozen run's trained policy, both reference paths on a fresh rollout
    for recompute, frozen in run_on_ranks(reference_paths, 2, STEPS, timeout=300):
        assert frozen.reference_diff is not None and frozen.reference_diff <= 1e-6
        print(f"frozen copy vs recompute logprobs: max |diff| {frozen.reference_diff:.2e}")
        penalties = [row["train_kl_penalty"] for row in frozen.rows]
        assert penalties[0] == 0.0 and min(penalties[1:]) > 0.0, penalties
        for got, want in zip(frozen.rows, recompute.rows, strict=True):
            assert got["reward"] == want["reward"]
            assert got["train_loss"] == pytest.approx(want["train_loss"], abs=1e-6)
            assert got["train_kl_penalty"] == pytest.approx(want["train_kl_penalty"], abs=1e-6)


@pytest.mark.timeout(400)  # measured 11-47 s per run at load 15-20 (2 cores), two runs
def test_rloo_and_reinforce_plus_plus_raise_the_reward():
    """40 steps of 16 prompts x 4 samples each (TP=1): RLOO (leave-one-out baseline, no std),
    REINFORCE++ with the k3 KL (beta 0.01) in the reward. The mean reward of the first 5 steps
    is a random policy's (``< 0.35``; 1/4 expected), that of the last 5 at least ``RISE`` higher.

    Where a trajectory ends depends on the sampling and on the CPU's rounding alike; measured
    over rollout seeds 1234 (this test's), 1-5, each with torch's default (AVX-512) kernels and
    with AVX2 ones (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
    ONEDNN_MAX_CPU_ISA=AVX2``): first 5 steps 0.245-0.275; rise RLOO 0.216-0.738 (seed 1234:
    0.267 -> 0.993; seed 2 plateaus at 0.49-0.55), REINFORCE++ 0.261-0.739 (seed 1234: 0.264 ->
    0.53, its slowest). ``RISE`` 0.1 is half the smallest, and 3 standard deviations of the
    difference of two 5-step means (320 samples each) of a policy that does not learn."""
    steps = 40
    recipes = [
        Recipe(options=RLOO, steps=steps),
        Recipe(options=REINFORCE_PP, kl=0.01, kl_in_reward=True, steps=steps),
    ]
    (runs,) = run_on_ranks(fits, 1, recipes, timeout=380)
    for name, run in zip(["rloo", "reinforce_plus_plus"], runs, strict=True):
        rewards = [row["reward"] for row in run.rows]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(f"{name}: reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
        assert len(rewards) == steps
        assert first < 0.35 and last >= first + RISE, (name, first, last)
    # the KL sits in the reward: none in the loss
    assert all(row["train_kl_penalty"] == 0.0 for row in runs[1].rows)
