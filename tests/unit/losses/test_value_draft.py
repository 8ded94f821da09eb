"""MseValueLossFn and DraftCrossEntropyLossFn."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import DT, check_invariance, t

from lightning_mcore_rl.losses import MseValueLossFn
from lightning_mcore_rl.losses.draft_loss import DraftCrossEntropyLossFn


def value_data() -> dict[str, torch.Tensor]:
    return {
        "token_mask": t([[1.0, 1.0, 1.0, 0.0]]),
        "sample_mask": t([1.0]),
        "returns": t([[1.5, 1.5, 1.5, 7.0]]),
        "values": t([[1.0, 1.0, 4.0, 0.0]]),
    }


def test_value_loss_hand_values() -> None:
    """v = [1, 2, 3], R = 1.5, old = [1, 1, 4], eps = 0.5 (4th token masked, unshifted mask):
    unclipped (v-R)^2 = [.25, .25, 2.25]; v_c = [1, 1.5, 3.5] -> [.25, 0, 4]; max -> [.25, .25, 4]
    loss = 0.5 * 4.5 / 3 = 0.75; clipfrac 1/3; grad = 0.5 * 2 (v - R) / 3 on the unclipped
    winners = [-1/6, 1/6, 0]. Without clipping: 0.5 * 2.75 / 3; scale 2 doubles it."""
    v = t([[1.0, 2.0, 3.0, 50.0]]).requires_grad_(True)
    loss, m = MseValueLossFn({"cliprange": 0.5})(value_data(), 1, 3, logits=v.unsqueeze(-1))
    loss.backward()
    assert loss.item() == pytest.approx(0.75)
    torch.testing.assert_close(v.grad, t([[-1 / 6, 1 / 6, 0.0, 0.0]]), rtol=1e-7, atol=1e-9)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert (m["values_min"].item(), m["values_max"].item()) == (1.0, 3.0)
    assert m["returns_mean"].item() == pytest.approx(1.5)
    assert m["values_mean"].item() == pytest.approx(2.0)
    assert m["returns_sq_mean"].item() == pytest.approx(2.25)
    assert m["residual_sq_mean"].item() == pytest.approx(2.75 / 3)
    loss, m = MseValueLossFn()(value_data(), 1, 3, logits=v)
    assert loss.item() == pytest.approx(0.5 * 2.75 / 3) and m["vf_clipfrac"].item() == 0.0
    loss, _ = MseValueLossFn({"scale": 2.0, "cliprange": 0.0})(value_data(), 1, 3, logits=v)
    assert loss.item() == pytest.approx(2.75 / 3)


@pytest.mark.parametrize("cliprange", [None, 0.3])
def test_value_gradcheck_masking_invariance(cliprange: float | None) -> None:
    """gradcheck; masked entries get zero gradient; 1/2/4-microbatch invariance (values_min/max
    combine with min/max); all-masked batch gives exactly 0 and +-inf extrema."""
    g = torch.Generator().manual_seed(0)
    data = {
        "token_mask": torch.ones(4, 5, dtype=DT),
        "sample_mask": t([1.0, 1.0, 0.0, 1.0]),
        "returns": torch.randn(4, 5, generator=g, dtype=DT),
        "values": torch.randn(4, 5, generator=g, dtype=DT),
    }
    data["token_mask"][0, 2:] = 0
    v = torch.randn(4, 5, generator=g, dtype=DT).requires_grad_(True)
    loss_fn = MseValueLossFn({"cliprange": cliprange})
    assert torch.autograd.gradcheck(lambda x: loss_fn(data, 3, 13, logits=x)[0], (v,))
    loss_fn(data, 3, 13, logits=v)[0].backward()
    assert (v.grad[2] == 0).all() and (v.grad[0, 2:] == 0).all()
    for n in (1, 2, 4):
        check_invariance(loss_fn, data, {"logits": v}, n, 3.0, 13.0)
    zero = dict(data, sample_mask=torch.zeros(4, dtype=DT))
    loss, m = loss_fn(zero, 0, 0, logits=v)
    assert loss.item() == 0.0 and m["values_min"].item() == math.inf


def test_value_bad_inputs() -> None:
    """Missing returns/old values and bad logits shapes raise."""
    data = value_data()
    v = t([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ValueError, match="missing the key `values`"):
        MseValueLossFn({"cliprange": 0.2})(
            {k: x for k, x in data.items() if k != "values"}, 1, 3, logits=v
        )
    with pytest.raises(ValueError, match="missing the key `returns`"):
        MseValueLossFn()({k: x for k, x in data.items() if k != "returns"}, 1, 3, logits=v)
    with pytest.raises(ValueError, match=r"`logits` must be \[B, S\] or \[B, S, 1\]"):
        MseValueLossFn()(data, 1, 3, logits=v.reshape(1, 2, 2))


def test_draft_hand_value_and_gradient() -> None:
    """teacher logits [0, ln 3] -> q = [1/4, 3/4]; student logits [0, 0] -> p = [1/2, 1/2]:
    CE = ln 2 per token; two valid tokens of three -> loss ln 2; grad (p - q) / N_t on valid
    tokens = [1/8, -1/8], zero on the masked one."""
    teacher = t([[[0.0, math.log(3.0)]] * 3])
    student = torch.zeros(1, 3, 2, dtype=DT, requires_grad=True)
    loss_fn = DraftCrossEntropyLossFn()
    loss, _ = loss_fn(
        {"sample_mask": t([1.0])},
        1,
        2,
        teacher_logits=teacher,
        student_logits=student,
        token_mask=t([[1.0, 1.0, 0.0]]),
    )
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2.0))
    expected = t([[[0.125, -0.125], [0.125, -0.125], [0.0, 0.0]]])
    torch.testing.assert_close(student.grad, expected, rtol=1e-7, atol=1e-9)


def test_draft_gradcheck_invariance_and_errors() -> None:
    """gradcheck w.r.t. the student logits; invariance; all-masked 0; shape errors."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(4, 3, 5, generator=g, dtype=DT)
    student = torch.randn(4, 3, 5, generator=g, dtype=DT).requires_grad_(True)
    tm = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    data = {"sample_mask": t([1.0, 1.0, 1.0, 0.0])}
    loss_fn = DraftCrossEntropyLossFn()
    inputs = {"teacher_logits": teacher, "student_logits": student, "token_mask": tm}
    assert torch.autograd.gradcheck(
        lambda s: loss_fn(data, 3, 6, **dict(inputs, student_logits=s))[0], (student,)
    )
    for n in (1, 2, 4):
        check_invariance(loss_fn, data, inputs, n, 3.0, 6.0)
    assert loss_fn({"sample_mask": torch.zeros(4, dtype=DT)}, 0, 0, **inputs)[0].item() == 0.0
    with pytest.raises(ValueError, match=r"`teacher_logits` must have shape \[4, 3, 5\]"):
        loss_fn(data, 3, 6, **dict(inputs, teacher_logits=teacher[:, :2]))
    with pytest.raises(ValueError, match=r"`token_mask` must have shape \[4, 3\]"):
        loss_fn(data, 3, 6, **dict(inputs, token_mask=tm[:, :2]))
