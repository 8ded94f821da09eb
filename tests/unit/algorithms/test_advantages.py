"""GRPO advantages and the toy task's reward, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.algorithms import grpo_advantages, token_level_advantages
from lightning_mcore_rl.rollout import ModularCountingTask


def test_group_mean_baseline_and_std():
    # group 1: rewards [1, 0, 0, 1], mean 0.5, unbiased std sqrt(1/3)
    # group 2: all equal -> advantage 0 (no signal), never NaN
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3], dtype=torch.float64)
    adv = grpo_advantages(rewards, 4, eps=0.0)
    s = (1 / 3) ** 0.5
    expected = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_leave_one_out_without_std():
    # r = [3, 1, 2]: baselines (1+2)/2, (3+2)/2, (3+1)/2 = 1.5, 2.5, 2
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 2.0]), 3, normalize_std=False, leave_one_out=True)
    torch.testing.assert_close(adv, torch.tensor([1.5, -1.5, 0.0]))


def test_token_level_broadcast_masks():
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    out = token_level_advantages(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))


def test_bad_input():
    with pytest.raises(ValueError, match="must be >= 1 and divide the number of rewards"):
        grpo_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=">= 2"):
        grpo_advantages(torch.ones(3), 1)
    with pytest.raises(ValueError, match=r"must be \[B\]"):
        token_level_advantages(torch.ones(3), torch.ones(2, 4))


def test_modular_counting_reward():
    task = ModularCountingTask(vocab_size=16, prompt_length=2, modulus=4)
    # prompt ends in 5 (residue 1): completion [6, 3, 4, 4] needs residues 2, 3, 0, 1 after
    # 5, 6, 3, 4: 6%4=2 yes, 3%4=3 yes, 4%4=0 yes, 4%4=0 != 1 no -> 3/4 (a repeat never scores)
    tokens = torch.tensor([[0, 5, 6, 3, 4, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    torch.testing.assert_close(task.rewards(tokens, mask), torch.tensor([3 / 4]))
    with pytest.raises(ValueError, match="modulus"):
        ModularCountingTask(vocab_size=16, modulus=1)
    with pytest.raises(ValueError, match="prompt_length"):
        ModularCountingTask(prompt_length=0)
