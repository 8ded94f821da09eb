"""DistillationLossFn (top-k KL) and OPDFullLossFn (full-vocabulary on-policy distillation)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _helpers import DT, check_invariance, t

from lightning_mcore_rl.losses import DistillationLossFn, OPDFullLossFn

LN = math.log
# One token, K = 2: student p = [0.5, 0.25] (0.25 left outside the top-k, on one token),
# teacher renormalised over its top-k q = [0.75, 0.25].
FWD = 0.75 * LN(1.5)  # sum q (log q - log p)
REV = 0.5 * LN(0.5 / 0.75)  # sum p (log p - log q)
H_ALL = 0.5 * LN(0.5) + 2 * 0.25 * LN(0.25)  # sum_v p log p over the full vocabulary
TAIL = 0.25 * LN(0.25) - (-100) * 0.25  # H_rest - (-100) P_rest


def one_token() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    data = {"token_mask": t([[1.0, 1.0]]), "sample_mask": t([1.0])}
    inputs = {
        "student_topk_logprobs": t([[[LN(0.5), LN(0.25)]]]),
        "teacher_topk_logprobs": t([[[LN(0.75), LN(0.25)]]]),
        "H_all": t([[H_ALL]]),
    }
    return data, inputs


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"kl_type": "forward"}, FWD),
        ({"kl_type": "reverse"}, REV),
        ({"kl_type": "mixed", "mixed_kl_weight": 0.5}, 0.5 * FWD + 0.5 * REV),
        ({"kl_type": "forward", "zero_outside_topk": True}, FWD),  # no tail for forward KL
        ({"kl_type": "reverse", "zero_outside_topk": True}, REV + TAIL),
        (
            {"kl_type": "mixed", "mixed_kl_weight": 0.25, "zero_outside_topk": True},
            0.25 * FWD + 0.75 * (REV + TAIL),
        ),
    ],
)
def test_topk_kl_hand_values(cfg: dict[str, Any], expected: float) -> None:
    """forward = 0.75 ln 1.5; reverse = 0.5 ln(2/3); the tail adds 0.25 (ln 0.25 + 100): the
    student's 0.25 outside the top-k matched against log p_t = -100 (module constants)."""
    data, inputs = one_token()
    loss, metrics = DistillationLossFn(cfg)(data, 1, 1, **inputs)
    assert loss.item() == pytest.approx(expected, rel=1e-7)
    assert metrics["num_valid_samples"].item() == 1.0


def random_topk(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """B = 4, S-1 = 5, K = 3; student top-k from a 6-token softmax, teacher renormalised."""
    g = torch.Generator().manual_seed(seed)
    student_full = torch.log_softmax(torch.randn(4, 5, 6, generator=g, dtype=DT), -1)
    teacher = torch.log_softmax(torch.randn(4, 5, 3, generator=g, dtype=DT), -1)
    tm = torch.ones(4, 6, dtype=DT)
    tm[1, 4:] = 0
    data = {"token_mask": tm, "sample_mask": t([1.0, 1.0, 0.0, 1.0])}
    inputs = {
        "student_topk_logprobs": student_full[..., :3].clone().requires_grad_(True),
        "teacher_topk_logprobs": teacher,
        "H_all": (student_full.exp() * student_full).sum(-1).requires_grad_(True),
    }
    return data, inputs


CFGS = [
    {"kl_type": kl, "zero_outside_topk": z}
    for kl in ("forward", "reverse", "mixed")
    for z in (False, True)
]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c['kl_type']}-{c['zero_outside_topk']}")
def test_topk_gradcheck_masking_invariance(cfg: dict[str, Any]) -> None:
    """gradcheck w.r.t. student logprobs and H_all; masked rows get zero gradient; 1/2/4
    microbatch invariance; all-masked batch gives exactly 0."""
    data, inputs = random_topk()
    loss_fn = DistillationLossFn(cfg)
    toks = float((data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum())
    teacher = inputs["teacher_topk_logprobs"]

    def f(s: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return loss_fn(
            data, 3, toks, student_topk_logprobs=s, teacher_topk_logprobs=teacher, H_all=h
        )[0]

    assert torch.autograd.gradcheck(f, (inputs["student_topk_logprobs"], inputs["H_all"]))
    f(inputs["student_topk_logprobs"], inputs["H_all"]).backward()
    assert (inputs["student_topk_logprobs"].grad[2] == 0).all()
    assert (inputs["student_topk_logprobs"].grad[1, 3:] == 0).all()
    for n in (1, 2, 4):
        check_invariance(loss_fn, data, inputs, n, 3.0, toks)
    zero = dict(data, sample_mask=torch.zeros(4, dtype=DT))
    assert loss_fn(zero, 0, 0, **inputs)[0].item() == 0.0


def test_topk_bad_inputs() -> None:
    """Missing H_all for the tail, shape mismatches and missing masks raise."""
    data, inputs = random_topk()
    with pytest.raises(ValueError, match="needs the `H_all` loss input"):
        DistillationLossFn({"kl_type": "reverse", "zero_outside_topk": True})(
            data, 3, 10, **dict(inputs, H_all=None)
        )
    with pytest.raises(ValueError, match=r"`teacher_topk_logprobs` must have shape \[4, 5, 3\]"):
        DistillationLossFn()(data, 3, 10, **dict(inputs, teacher_topk_logprobs=t([[[0.0]]])))
    with pytest.raises(ValueError, match="missing the key `token_mask`"):
        DistillationLossFn()({"sample_mask": data["sample_mask"]}, 3, 10, **inputs)


def opd_data(rows: int = 1) -> dict[str, torch.Tensor]:
    data = {"token_mask": t([[1.0, 1.0, 1.0, 0.0]] * rows), "sample_mask": t([1.0] * rows)}
    data["reference_policy_logprobs"] = t([[0.0, -1.5, -1.0, 0.0]] * rows)
    return data


def test_opd_full_hand_values() -> None:
    """divergence [0.2, 0.4, 9 (masked)] -> loss 0.3, min 0.2, max 0.4; d loss / d div = m / 2.
    entropy input sum p log p = [-1, -2] -> metric 1.5; CE [1.2, 2.4] -> 1.8; residual
    |negH + CE - KL| = 0. Sequence-level on 2 samples with token means 0.3 and 0.3 -> 0.3."""
    div = t([[0.2, 0.4, 9.0]]).requires_grad_(True)
    extra = {
        "opd_full_entropy": t([[-1.0, -2.0, 5.0]]),
        "opd_full_cross_entropy": t([[1.2, 2.4, 0.0]]),
    }
    loss, m = OPDFullLossFn()(opd_data(), 1, 2, opd_full_divergence=div, **extra)
    loss.backward()
    assert loss.item() == pytest.approx(0.3)
    torch.testing.assert_close(div.grad, t([[0.5, 0.5, 0.0]]), rtol=1e-7, atol=1e-9)
    assert m["opd_full_reverse_kl_min"].item() == pytest.approx(0.2)
    assert m["opd_full_reverse_kl_max"].item() == pytest.approx(0.4)
    assert m["opd_full_entropy"].item() == pytest.approx(1.5)
    assert m["opd_full_cross_entropy"].item() == pytest.approx(1.8)
    assert m["opd_full_decomposition_error"].item() == pytest.approx(0.0, abs=1e-12)
    seq = OPDFullLossFn({"token_level_loss": False})
    loss, _ = seq(opd_data(2), 2, 4, opd_full_divergence=div.detach().repeat(2, 1))
    assert loss.item() == pytest.approx(0.3)


def test_opd_full_reference_kl() -> None:
    """beta = 0.1, c = [-1, -2], ref = [-1.5, -1] (k3): loss = 0.3 + 0.1 * mean(k3) with
    k3 = [e^-0.5 - 0.5, e - 2]; d/dc = 0.1 * (c - ref) / 2 (score-function weight). Warns."""
    with pytest.warns(UserWarning, match="adds a second KL"):
        loss_fn = OPDFullLossFn({"reference_policy_kl_penalty": 0.1})
    c = t([[-1.0, -2.0, 0.0]]).requires_grad_(True)
    div = t([[0.2, 0.4, 0.0]])
    loss, m = loss_fn(opd_data(), 1, 2, opd_full_divergence=div, next_token_logprobs=c)
    loss.backward()
    k3 = [math.exp(-0.5) - 0.5, math.e - 2]
    assert loss.item() == pytest.approx(0.3 + 0.1 * sum(k3) / 2)
    assert m["kl_penalty"].item() == pytest.approx(sum(k3) / 2)
    torch.testing.assert_close(c.grad, t([[0.025, -0.05, 0.0]]), rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match="needs the `next_token_logprobs` loss input"):
        loss_fn(opd_data(), 1, 2, opd_full_divergence=div)
    with pytest.raises(ValueError, match=r"`opd_full_divergence` must be \[B, S-1\]"):
        loss_fn(opd_data(), 1, 2, opd_full_divergence=div[0])


@pytest.mark.parametrize("token_level", [True, False])
def test_opd_full_gradcheck_invariance(token_level: bool) -> None:
    """gradcheck w.r.t. the divergence; invariance over 1/2/4 microbatches; all-masked 0."""
    g = torch.Generator().manual_seed(0)
    data = {"token_mask": torch.ones(4, 6, dtype=DT), "sample_mask": t([1.0, 0.0, 1.0, 1.0])}
    data["token_mask"][0, 3:] = 0
    inputs = {
        "opd_full_divergence": torch.rand(4, 5, generator=g, dtype=DT).requires_grad_(True),
        "opd_full_entropy": -torch.rand(4, 5, generator=g, dtype=DT),
        "opd_full_cross_entropy": torch.rand(4, 5, generator=g, dtype=DT),
    }
    loss_fn = OPDFullLossFn({"token_level_loss": token_level})
    assert torch.autograd.gradcheck(
        lambda d: loss_fn(data, 3, 12, opd_full_divergence=d)[0], (inputs["opd_full_divergence"],)
    )
    for n in (1, 2, 4):
        check_invariance(loss_fn, data, inputs, n, 3.0, 12.0)
    zero = dict(data, sample_mask=torch.zeros(4, dtype=DT))
    assert loss_fn(zero, 0, 0, **inputs)[0].item() == 0.0
