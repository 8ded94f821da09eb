"""NLLLossFn, PreferenceLossFn and DPOLossFn."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _helpers import DT, check_invariance, t

from lightning_mcore_rl.losses import DPOLossFn, NLLLossFn, PreferenceLossFn


def masks(tm_rows: list[list[float]], sm: list[float]) -> dict[str, torch.Tensor]:
    """``token_mask [B, S]`` (position 0 = 1, dropped) and ``sample_mask [B]``."""
    tm = t(tm_rows)
    return {
        "token_mask": torch.cat([torch.ones(len(sm), 1, dtype=DT), tm], 1),
        "sample_mask": t(sm),
    }


def test_nll_token_mean_and_per_sample() -> None:
    """c = [[-1,-2,-3],[-4,-5,-6]], row 1 has 2 valid tokens: loss = 15/5 = 3, grad -m/5.
    dpo_loss: per-sample [6, 9]; averaged [6/3, 9/2]."""
    data = masks([[1, 1, 1], [1, 1, 0]], [1, 1])
    c = t([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]).requires_grad_(True)
    loss, metrics = NLLLossFn()(data, 2, 5, next_token_logprobs=c)
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    torch.testing.assert_close(c.grad, -t([[1, 1, 1], [1, 1, 0]]) / (5 + 1e-8))
    assert metrics["num_unmasked_tokens"].item() == 5 and metrics["num_valid_samples"].item() == 2
    per_sample, _ = NLLLossFn()(data, 2, 5, next_token_logprobs=c, dpo_loss=True)
    assert per_sample.tolist() == pytest.approx([6.0, 9.0])
    averaged, _ = NLLLossFn()(
        data, 2, 5, next_token_logprobs=c, dpo_loss=True, dpo_average_log_probs=True
    )
    assert averaged.tolist() == pytest.approx([2.0, 4.5])


def dpo_data(c_ref: list[list[float]], tm: list[list[float]], sm: list[float]) -> dict[str, Any]:
    """DPO batch; the stored reference is rolled left, so its last column is junk (99)."""
    data = masks(tm, sm)
    ref = t(c_ref)
    data["reference_policy_logprobs"] = torch.cat(
        [ref, torch.full((len(sm), 1), 99.0, dtype=DT)], 1
    )
    return data


def test_dpo_hand_value() -> None:
    """One pair, c = [[-1,-1],[-2,-2]], ref = -1.5: rho_c = 1, rho_r = -1, beta = 0.5:
    loss = -log sigmoid(0.5 * 2) = log(1 + e^-1); d/drho_c = -beta (1 - sigmoid(1)) per chosen
    token, the negative for rejected. SFT weight 0.1: + 0.1 * NLL_chosen = 0.1 * 2, grad -0.1.
    preference_average_log_probs: rho = +-0.5 -> -log sigmoid(0.5)."""
    data = dpo_data([[-1.5, -1.5]] * 2, [[1, 1]] * 2, [1, 1])
    c = t([[-1.0, -1.0], [-2.0, -2.0]]).requires_grad_(True)
    cfg = {"reference_policy_kl_penalty": 0.5, "sft_loss_weight": 0.1}
    loss, m = DPOLossFn(cfg)(data, 2, 4, next_token_logprobs=c)
    loss.backward()
    pref = math.log1p(math.exp(-1.0))
    assert m["preference_loss"].item() == pytest.approx(pref)
    assert m["sft_loss"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(pref + 0.2)
    g = 0.5 * (1 - 1 / (1 + math.exp(-1.0)))
    torch.testing.assert_close(c.grad, t([[-g - 0.1, -g - 0.1], [g, g]]), rtol=1e-7, atol=1e-9)
    assert m["accuracy"].item() == pytest.approx(1.0)
    assert m["rewards_chosen_mean"].item() == pytest.approx(1.0)
    assert m["rewards_rejected_mean"].item() == pytest.approx(-1.0)
    assert m["num_valid_samples"].item() == 1.0
    averaged = DPOLossFn({"reference_policy_kl_penalty": 0.5, "preference_average_log_probs": True})
    loss, _ = averaged(data, 2, 4, next_token_logprobs=c)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.5))))


def test_preference_hand_value() -> None:
    """Scores [2, 1, 0, 3] -> pairs Delta = 1, -3: loss (log(1+e^-1) + log(1+e^3)) / 2,
    accuracy 1/2, chosen mean 1, rejected mean 2. dL/dchosen_i = -(1 - sigmoid(Delta_i)) / 2."""
    logits = t([[2.0], [1.0], [0.0], [3.0]]).requires_grad_(True)
    loss, m = PreferenceLossFn()({"sample_mask": t([1.0] * 4)}, 4, None, logits=logits)
    loss.backward()
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(3))) / 2)
    assert (m["accuracy"].item(), m["rewards_chosen_mean"].item()) == pytest.approx((0.5, 1.0))
    assert m["rewards_rejected_mean"].item() == pytest.approx(2.0)
    sig = torch.sigmoid(t([1.0, -3.0]))
    expected = torch.stack([-(1 - sig) / 2, (1 - sig) / 2], 1).reshape(4, 1)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-7, atol=1e-9)


def random_pair_batch(seed: int = 0) -> tuple[dict[str, Any], torch.Tensor]:
    """8 samples (4 pairs), ragged masks, the last pair masked."""
    g = torch.Generator().manual_seed(seed)
    tm = torch.ones(8, 5, dtype=DT)
    tm[1::3, 3:] = 0
    sm = t([1, 1, 1, 1, 1, 1, 0, 0])
    data = dpo_data(
        (-torch.rand(8, 5, generator=g, dtype=DT) * 2).tolist(), tm.tolist(), sm.tolist()
    )
    c = (-torch.rand(8, 5, generator=g, dtype=DT) * 2).requires_grad_(True)
    return data, c


DPO_CFGS = {
    "plain": {},
    "sft_avg": {
        "sft_loss_weight": 0.3,
        "sft_average_log_probs": True,
        "preference_average_log_probs": True,
    },
    "sft_sum": {"sft_loss_weight": 0.7, "preference_loss_weight": 0.5},
}


@pytest.mark.parametrize("name", sorted(DPO_CFGS))
def test_dpo_gradcheck_masking_invariance(name: str) -> None:
    """gradcheck; masked pair/tokens have zero gradient; invariance over 1, 2, 4 microbatches;
    all-masked batch gives exactly 0."""
    data, c = random_pair_batch()
    loss_fn = DPOLossFn(DPO_CFGS[name])
    assert torch.autograd.gradcheck(lambda x: loss_fn(data, 6, 20, next_token_logprobs=x)[0], (c,))
    loss, _ = loss_fn(data, 6, 20, next_token_logprobs=c)
    loss.backward()
    invalid = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)) == 0
    assert (c.grad[invalid] == 0).all()
    for n in (1, 2, 4):
        check_invariance(loss_fn, data, {"next_token_logprobs": c}, n, 6.0, 20.0)
    zero = dict(data, sample_mask=torch.zeros(8, dtype=DT))
    assert loss_fn(zero, 0, 0, next_token_logprobs=c)[0].item() == 0.0


def test_nll_and_preference_gradcheck_masking_invariance() -> None:
    """NLL and preference losses: gradcheck, zero effect of masked entries, invariance."""
    data, c = random_pair_batch()
    nll = NLLLossFn()
    assert torch.autograd.gradcheck(lambda x: nll(data, 6, 20, next_token_logprobs=x)[0], (c,))
    pref = PreferenceLossFn()
    scores = c[:, :1].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: pref(data, 6, None, logits=x)[0], (scores,))
    pref(data, 6, None, logits=scores)[0].backward()
    assert (scores.grad[6:] == 0).all()
    for n in (1, 2, 4):
        check_invariance(nll, data, {"next_token_logprobs": c}, n, 6.0, 20.0)
        check_invariance(pref, data, {"logits": scores}, n, 6.0, 20.0)
    zero = dict(data, sample_mask=torch.zeros(8, dtype=DT))
    assert nll(zero, 0, 0, next_token_logprobs=c)[0].item() == 0.0
    assert pref(zero, 0, None, logits=scores)[0].item() == 0.0


def test_bad_inputs() -> None:
    """Odd batches, missing reference logprobs and mis-shaped inputs raise."""
    data, c = random_pair_batch()
    with pytest.raises(ValueError, match="batch size must be even; got 7"):
        DPOLossFn()({k: v[:7] for k, v in data.items()}, 6, 20, next_token_logprobs=c[:7])
    no_ref = {k: v for k, v in data.items() if k != "reference_policy_logprobs"}
    with pytest.raises(ValueError, match="missing the key `reference_policy_logprobs`"):
        DPOLossFn()(no_ref, 6, 20, next_token_logprobs=c)
    with pytest.raises(ValueError, match=r"`logits` must have shape \[8\], got \[8, 2\]"):
        PreferenceLossFn()(data, 6, None, logits=c[:, :2].squeeze(-1))
    with pytest.raises(ValueError, match=r"`next_token_logprobs` must be \[B, S-1\]"):
        NLLLossFn()(data, 6, 20, next_token_logprobs=c[0])
