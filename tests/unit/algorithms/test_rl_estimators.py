"""RLOO, REINFORCE++ and GAE advantages against hand-derived values (fp64)."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.algorithms import (
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    terminal_token_rewards,
)

F64 = torch.float64


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    # group of 4, rewards [1, 0, 0, 1]: each baseline is the mean of the other three,
    # 1/3 for the rewarded samples (others 0, 0, 1) and 2/3 for the others (1, 0, 1)
    adv = grpo_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64), 4, normalize_std=False, leave_one_out=True
    )
    torch.testing.assert_close(adv, torch.tensor([2, -2, -2, 2], dtype=F64) / 3)


def test_reinforce_plus_plus_equal_lengths():
    # groups [1, 0, 0, 1] (mean 0.5) and [1, 1, 1, 0] (mean 0.75): r - mean =
    # [.5, -.5, -.5, .5, .25, .25, .25, -.75]; two tokens per row, so the token mean is 0 and the
    # population variance (4 * .25 + 3 * .0625 + .5625) / 8 = 0.21875
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 0], dtype=F64)
    mask = torch.tensor([[0, 1, 1]] * 8, dtype=F64)
    adv = reinforce_plus_plus_advantages(rewards, 4, mask)
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75], dtype=F64)
    expected = centred[:, None] / 0.21875**0.5 * mask
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_with_kl_in_reward_and_ragged_mask():
    # rewards [1, 0] in a group of 2 -> [.5, -.5]; tokens minus 0.5 * kl: row 0 (two tokens)
    # .5 - .1 = .4, .5 - .2 = .3; row 1 (one token) -.5 - .05 = -.55. Mean over the 3 valid
    # tokens .05, deviations [.35, .25, -.6], population variance .545 / 3
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=F64)
    kl = torch.tensor([[9.0, 0.2, 0.4], [9.0, 0.1, 9.0]], dtype=F64)
    adv = reinforce_plus_plus_advantages(rewards, 2, mask, kl=kl, kl_coef=0.5)
    scale = (0.545 / 3) ** -0.5
    expected = torch.tensor([[0, 0.35, 0.25], [0, -0.6, 0]], dtype=F64) * scale
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_without_baseline_whitens_the_raw_rewards():
    # rewards [3, 1], one token each: mean 2, population variance 1 -> [1, -1]
    mask = torch.tensor([[0, 1], [0, 1]], dtype=F64)
    adv = reinforce_plus_plus_advantages(
        torch.tensor([3.0, 1.0], dtype=F64), 2, mask, minus_baseline=False
    )
    torch.testing.assert_close(adv, torch.tensor([[0, 1.0], [0, -1.0]], dtype=F64))


def test_masked_whiten_unbiased_and_kl_shape_error():
    # valid [1, 3]: mean 2, unbiased variance 2
    x = torch.tensor([[1.0, 3.0, 100.0]], dtype=F64)
    out = masked_whiten(x, torch.tensor([[1, 1, 0]]), unbiased=True)
    torch.testing.assert_close(out[0, :2], torch.tensor([-1.0, 1.0], dtype=F64) / 2**0.5)
    with pytest.raises(ValueError, match=r"`kl` \(2, 2\) must match token_mask \(2, 3\)"):
        reinforce_plus_plus_advantages(
            torch.ones(2), 2, torch.ones(2, 3), kl=torch.ones(2, 2), kl_coef=0.1
        )


def test_terminal_token_rewards():
    # the reward lands on each row's last valid token; -0.1 * kl on every valid token
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    rewards = torch.tensor([2.0, 3.0, 5.0], dtype=F64)
    torch.testing.assert_close(
        terminal_token_rewards(rewards, mask),
        torch.tensor([[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]], dtype=F64),
    )
    with_kl = terminal_token_rewards(rewards, mask, torch.ones(3, 4, dtype=F64), 0.1)
    torch.testing.assert_close(
        with_kl,
        torch.tensor([[0, -0.1, 1.9, 0], [0, -0.1, -0.1, 2.9], [0, 0, 0, 0]], dtype=F64),
    )


def test_gae_hand_derived():
    # gamma .9, lambda .5, values V = [_, 1, 2, 3] on tokens 1..3, reward 1 on token 3:
    # t=3: delta = 1 - 3 = -2, A = -2; t=2: delta = .9*3 - 2 = .7, A = .7 + .45*(-2) = -.2;
    # t=1: delta = .9*2 - 1 = .8, A = .8 + .45*(-.2) = .71; returns A + V
    values = torch.tensor([[9.0, 1.0, 2.0, 3.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1]])
    rewards = torch.tensor([[0, 0, 0, 1.0]], dtype=F64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.71, -0.2, -2.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 1.71, 1.8, 1.0]], dtype=F64))
    # gamma = lambda = 1: Monte-Carlo return minus value
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.0, -1.0, -2.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 1.0, 1.0, 1.0]], dtype=F64))


def test_gae_carries_over_masked_gaps():
    # token 2 is masked: token 1 bootstraps from token 3 (V = 3, A = -2):
    # delta = .9*3 - 1 = 1.7, A = 1.7 + .45*(-2) = .8
    values = torch.tensor([[9.0, 1.0, 7.0, 3.0]], dtype=F64)
    mask = torch.tensor([[0, 1, 0, 1]])
    rewards = torch.tensor([[0, 0, 0, 1.0]], dtype=F64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.8, 0, -2.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 1.8, 0, 1.0]], dtype=F64))
    with pytest.raises(ValueError, match="must be the same"):
        gae_advantages(rewards, values[:, :3], mask, 1.0, 1.0)
