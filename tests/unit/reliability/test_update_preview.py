"""The update preview (`reliability/update_preview.py`) against torch's own optimizers: the
measures it predicts before an update equal those of the update torch then runs."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mcore_rl.reliability.nonfinite import NonFiniteGuard, UpdateChecks
from lightning_mcore_rl.reliability.update_check import UpdateSnapshot, update_measures
from lightning_mcore_rl.reliability.update_preview import preview_measures, previewable

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adam_l2": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.3}),
    "adam_decoupled": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.3,
                                          "decoupled_weight_decay": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.3, "betas": (0.8, 0.9)}),
    "adam_amsgrad_maximize": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True,
                                                 "maximize": True, "eps": 1e-3}),
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2,
                                       "weight_decay": 0.01}),
    "sgd_nesterov_maximize": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                                "maximize": True}),
}  # fmt: skip


def _member(name: str) -> tuple[SimpleNamespace, list[torch.nn.Parameter]]:
    """A megatron-like member (``.optimizer``: a torch optimizer) over three parameters; the
    last one never gets a gradient (torch leaves it as it is)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.randn(5)))
    cls, options = OPTIMIZERS[name]
    return SimpleNamespace(optimizer=cls(params, **options)), params


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in params[:-1]:
        p.grad = torch.randn(p.shape, generator=generator)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_preview_predicts_the_measures_of_torchs_update(name: str) -> None:
    """Three steps (the first creates the state): the previewed ``(non-finite tensors,
    ||update||, ||parameters||)`` equal ``update_measures`` of the update torch runs, in blocks
    smaller than a parameter (4 of 21 elements) and whole. fp32: the same formulas, rtol 1e-5
    for rounding in a different order."""
    member, params = _member(name)
    assert previewable(member)
    for step in range(3):
        _grads(params, step)
        before = [p.detach().clone() for p in params]
        blocks = preview_measures(member, "cpu", None, block=4)
        whole = preview_measures(member, "cpu", None)
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # read only
        snapshot = UpdateSnapshot.take(member, params)
        member.optimizer.step()
        count, delta, norm = update_measures(snapshot, "cpu", None)
        assert delta > 0.0
        for predicted in (blocks, whole):
            assert predicted[0] == count == 0.0
            assert predicted[1] == pytest.approx(delta, rel=1e-5), step
            assert predicted[2] == pytest.approx(norm, rel=1e-6), step


def test_the_preview_counts_the_tensors_the_update_would_make_non_finite() -> None:
    """A corrupt Adam second moment (negative entries: its square root is NaN) makes the
    parameter's update NaN; an overflowing gradient square makes ``exp_avg_sq`` inf: counted as
    the update would leave them."""
    member, params = _member("adam")
    _grads(params, 0)
    member.optimizer.step()
    _grads(params, 1)
    member.optimizer.state[params[0]]["exp_avg_sq"][0, :2] = -1.0
    params[1].grad[2, 1] = 1e30  # its square overflows fp32; the gradient itself is finite
    count, delta, _ = preview_measures(member, "cpu", None, block=4)
    snapshot = UpdateSnapshot.take(member, params)
    member.optimizer.step()
    assert (count, math.isnan(delta)) == (update_measures(snapshot, "cpu", None)[0], True)
    # params[0]: sqrt of a negative second moment, a NaN update; params[1]: exp_avg_sq inf
    # (its update m / inf is 0, finite)
    assert count == 2.0


def test_only_torchs_adam_adamw_and_sgd_are_previewed() -> None:
    params = [torch.nn.Parameter(torch.randn(3))]

    class MyAdam(torch.optim.Adam):
        pass

    def member(optimizer: Any, stub: bool = False) -> SimpleNamespace:
        return SimpleNamespace(optimizer=optimizer, is_stub_optimizer=stub)

    adam = member(torch.optim.Adam(params))
    assert previewable(adam)
    assert previewable(SimpleNamespace(chained_optimizers=[adam, member(None, stub=True)]))
    assert not previewable(member(MyAdam(params)))
    assert not previewable(member(torch.optim.RMSprop(params)))
    assert not previewable(SimpleNamespace(chained_optimizers=[adam, member(MyAdam(params))]))
    with pytest.raises(ValueError, match="needs torch Adam/AdamW/SGD"):
        preview_measures(member(torch.optim.RMSprop(params)), "cpu", None)


def test_the_guard_rejects_a_previewed_update_before_it_runs_and_snapshots_the_rest() -> None:
    """lr=1e8: the preview's update is 1e8 x the parameters' norm, so the guard skips the step
    and nothing is run or copied; an optimizer that cannot be previewed gets a snapshot."""
    member, params = _member("adam")
    member.optimizer.param_groups[0]["lr"] = 1e8
    _grads(params, 0)
    guard = NonFiniteGuard(max_update_ratio=1e3)
    checks = UpdateChecks(guard, "cpu", None)
    with pytest.warns(UserWarning, match="the update was not applied"):
        assert checks.reject_before_update(member)
    assert guard.step_skipped and checks.snapshot(member, params) is None
    unverified = UpdateChecks(NonFiniteGuard(verify_updates=False), "cpu", None)
    assert not unverified.reject_before_update(member)
    rmsprop = SimpleNamespace(optimizer=torch.optim.RMSprop(params))
    assert not checks.reject_before_update(rmsprop)
    assert isinstance(checks.snapshot(rmsprop, params), UpdateSnapshot)
