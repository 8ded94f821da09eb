"""The update certificate (`reliability/update_bound.py`) against torch's own Adam/AdamW and the
exact preview: its bound is never below the norm of the update torch runs, it passes ordinary
updates, and it never certifies one the preview rejects."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mcore_rl.reliability.nonfinite import NonFiniteGuard, UpdateChecks
from lightning_mcore_rl.reliability.update_bound import (
    bound_measures,
    certifiable,
    certify_update,
)
from lightning_mcore_rl.reliability.update_check import update_failure
from lightning_mcore_rl.reliability.update_preview import preview_measures

CONFIGS = {
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adam_l2": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.3}),
    "adam_decoupled": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.3,
                                          "decoupled_weight_decay": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.9)}),
    "adamw_maximize_eps": (torch.optim.AdamW, {"lr": 0.5, "eps": 1e-3, "maximize": True,
                                               "betas": (0.5, 0.99)}),
    "adam_beta1_zero": (torch.optim.Adam, {"lr": 1e-3, "betas": (0.0, 0.95)}),
    "adam_beta2_low": (torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.82)}),
}  # fmt: skip


def _member(name: str, shapes: Any = ((7, 3), (7, 3), (5,))) -> tuple[Any, list[Any]]:
    """A megatron-like member (`.optimizer`: a torch optimizer); the last parameter never gets
    a gradient."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    cls, options = CONFIGS[name]
    return SimpleNamespace(optimizer=cls(params, **options)), params


def _exact_update_norm(member: Any, params: list[Any]) -> float:
    """Run torch's step; the norm of what it changed (float64 differences)."""
    before = [p.detach().double().clone() for p in params]
    member.optimizer.step()
    changes = [p.detach().double() - b for p, b in zip(params, before, strict=True)]
    return math.sqrt(sum(float(c.square().sum()) for c in changes))


def _gradients(kind: str, step: int, shape: Any, generator: torch.Generator) -> torch.Tensor:
    """A gradient of the sequence `kind` at `step`."""
    if kind == "random":
        scale = 10.0 ** float(torch.randint(-6, 3, (), generator=generator))
        return torch.randn(shape, generator=generator) * scale
    if kind == "growing":
        # same sign, x 1/0.9 each step: near Cauchy-Schwarz's equality case, |m|/sqrt(v) largest
        return torch.ones(shape) * 0.9 ** (-step)
    if kind == "spike":
        return torch.full(shape, 1e3 if step == 7 else 1e-6)
    if kind == "tiny":
        # squares below float32's normal range: v underflows beside a nonzero m
        return torch.full(shape, 1e-22 if step % 2 else -3e-25)
    if kind == "zero_then_some":
        return torch.zeros(shape) if step < 5 else torch.randn(shape, generator=generator)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "growing", "spike", "tiny", "zero_then_some"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_bound_is_never_below_torchs_update(name: str, kind: str) -> None:
    """30 steps of each gradient sequence: before every step, the bound is >= the norm of the
    update torch's step then makes (float64 differences), and >= the preview's; ||parameters||
    equals the preview's."""
    member, params = _member(name)
    assert certifiable(member)
    generator = torch.Generator().manual_seed(1)
    ratios = []
    for step in range(30):
        for p in params[:-1]:
            p.grad = _gradients(kind, step, p.shape, generator)
        count, bound, norm = bound_measures(member, "cpu", None, block=4)
        _, previewed, previewed_norm = preview_measures(member, "cpu", None, block=4)
        exact = _exact_update_norm(member, params)
        assert count == 0.0
        assert bound >= exact and bound >= previewed, (step, bound, exact, previewed)
        assert norm == pytest.approx(previewed_norm, rel=1e-6)
        ratios.append(bound / max(exact, 1e-30))
    if kind == "growing" and name == "adam":
        # the bound is within its rounding allowance of the worst case, which this sequence
        # reaches at the first step (sign-like, |u_i| = 1)
        assert ratios[0] == pytest.approx(1.0, abs=2e-3)


def test_a_single_element_worst_case_is_tight() -> None:
    """One element, gradients in Cauchy-Schwarz's equality case: |m| / sqrt(v) climbs to the R
    the bound assumes (which the gradient's size cannot change), so from step 60 the bound is
    within 1% of the update (and above it at every step)."""
    member, params = _member("adam", shapes=((1,),))
    beta1, beta2 = member.optimizer.param_groups[0]["betas"]
    for step in range(80):
        params[0].data.fill_(1.0)  # new - old exact to 6e-8 (the bound allows 1e-6 ||p||)
        # g_{t-k} proportional to (beta1 / beta2)^k: newer gradients larger
        params[0].grad = torch.tensor([(beta2 / beta1) ** step])
        _, bound, _ = bound_measures(member, "cpu", None)
        exact = _exact_update_norm(member, params)
        assert exact <= bound, step
        if step >= 60:
            assert bound <= exact * 1.01, step


def test_ordinary_updates_are_certified_and_pass_the_preview() -> None:
    """AdamW at lr=1e-3 on unit-scale gradients: every step certified under the default ratio
    (so the preview is not run), and the preview agrees that each passes."""
    member, params = _member("adamw")
    generator = torch.Generator().manual_seed(2)
    for _ in range(10):
        for p in params[:-1]:
            p.grad = torch.randn(p.shape, generator=generator)
        assert certify_update(member, "cpu", None, 1e3)
        assert certify_update(member, "cpu", None, None)
        assert update_failure(preview_measures(member, "cpu", None), 1e3) is None
        member.optimizer.step()


def _stepped(name: str = "adam") -> tuple[Any, list[Any]]:
    """A member after two ordinary steps, with a third step's gradients."""
    member, params = _member(name)
    for step in range(3):
        for p in params[:-1]:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        if step < 2:
            member.optimizer.step()
    return member, params


def _corrupt(member: Any, params: list[Any], how: str) -> None:
    state = member.optimizer.state[params[0]]
    if how == "lr":
        member.optimizer.param_groups[0]["lr"] = 1e8
    elif how == "nan_gradient":
        params[1].grad[0, 0] = float("nan")
    elif how == "inf_gradient":
        params[1].grad[3, 2] = float("inf")
    elif how == "huge_gradient":
        params[1].grad[2, 1] = 1e30  # finite, its square overflows float32
    elif how == "inf_exp_avg":
        state["exp_avg"][1, 1] = float("inf")
    elif how == "nan_exp_avg_sq":
        state["exp_avg_sq"][0, 0] = float("nan")
    elif how == "inf_exp_avg_sq":
        state["exp_avg_sq"][0, 2] = float("inf")
    elif how == "negative_exp_avg_sq":
        state["exp_avg_sq"][0, :2] = -1.0
    elif how == "inf_weight":
        params[0].data[4, 0] = float("inf")
    elif how == "foreign_moments":
        # a state this optimizer could not produce (m far above sqrt(v)) and no gradient to
        # outweigh it: an update of ~1e8 x lr per element
        state["exp_avg"].fill_(1.0)
        state["exp_avg_sq"].fill_(1e-30)
        params[0].grad.zero_()
    else:
        raise ValueError(how)


CORRUPTIONS = [
    "lr",
    "nan_gradient",
    "inf_gradient",
    "huge_gradient",
    "inf_exp_avg",
    "nan_exp_avg_sq",
    "inf_exp_avg_sq",
    "negative_exp_avg_sq",
    "inf_weight",
    "foreign_moments",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_failing_update_is_not_certified_and_the_guard_still_rejects_it(how: str) -> None:
    """Every way the preview fails an update (lr=1e8, a NaN/inf/overflowing gradient, a
    non-finite or negative moment, an inf weight, moments from elsewhere with m >> sqrt(v)):
    the certificate does not pass it, and the guard's check rejects it before it runs, the
    parameters and state untouched."""
    member, params = _stepped()
    _corrupt(member, params, how)
    assert update_failure(preview_measures(member, "cpu", None), 1e3) is not None
    assert not certify_update(member, "cpu", None, 1e3)
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in member.optimizer.state[params[0]].items()}
    guard = NonFiniteGuard(max_update_ratio=1e3)
    with pytest.warns(UserWarning, match="the update was not applied"):
        assert UpdateChecks(guard, "cpu", None).reject_before_update(member)
    assert guard.step_skipped
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0, equal_nan=True)
    after = member.optimizer.state[params[0]]
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True)


def test_only_plain_adam_and_adamw_are_certified() -> None:
    """SGD, amsgrad, eps=0, a subclass and bf16 parameters go to the preview."""
    params = [torch.nn.Parameter(torch.randn(3))]

    class MyAdam(torch.optim.Adam):
        pass

    def member(optimizer: Any) -> SimpleNamespace:
        return SimpleNamespace(optimizer=optimizer)

    assert certifiable(member(torch.optim.AdamW(params)))
    assert not certifiable(member(torch.optim.SGD(params, lr=0.1)))
    assert not certifiable(member(torch.optim.Adam(params, amsgrad=True)))
    assert not certifiable(member(torch.optim.Adam(params, eps=0.0)))
    # beta1^2 >= beta2: |m| / sqrt(v) has no bound
    assert not certifiable(member(torch.optim.Adam(params, betas=(0.99, 0.9))))
    assert not certifiable(member(MyAdam(params)))
    bf16 = [torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    assert not certifiable(member(torch.optim.Adam(bf16)))
    sgd = member(torch.optim.SGD(params, lr=0.1))
    assert not certify_update(sgd, "cpu", None, 1e3)


def test_megatrons_gradient_norm_stands_in_for_reading_the_gradients() -> None:
    """With the global gradient norm as the bound on every entry, the certificate passes the
    same ordinary update without reading the gradients; a norm that is not finite (which the
    guard skips before) certifies nothing; through the guard, `grad_norm_fails` hands it on."""
    member, params = _stepped("adamw")
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in params[:-1]))
    read = bound_measures(member, "cpu", None)
    given = bound_measures(member, "cpu", None, grad_bound=norm)
    assert read[0] == given[0] == 0.0 and read[1:] == given[1:]  # decoupled decay: no g in it
    assert certify_update(member, "cpu", None, 1e3, grad_bound=norm)
    assert not certify_update(member, "cpu", None, 1e3, grad_bound=math.inf)
    checks = UpdateChecks(NonFiniteGuard(), "cpu", None)
    assert not checks.grad_norm_fails(norm)
    assert not checks.reject_before_update(member)
