"""MoE through the step (``train.run_global_batch``, ClippedPG, tiny MoE GPT, E=4, top-2): the
router losses enter the loss once with megatron's coefficients — the gradients equal an
independent single-process reference that adds ``aux * A + z * Z`` computed from the router
weights by plain autograd — and the router statistics equal the reference's counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _strategy_moe_runs import MoESpec, fit_error_rank, fit_moe_rank, reference_rank, step_rank

from lightning_mcore_rl.testing import run_on_ranks


def max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "spec",
    [
        MoESpec(ep=2, aux=0.1, z=0.01),
        MoESpec(ep=2, tp=2, aux=0.1, z=0.01),
        MoESpec(ep=2, aux=0.1, capacity=0.5),
    ],
    ids=["dp2-ep2", "tp2-sp-ep2-etp1", "dp2-ep2-capacity"],
)
def test_router_losses_and_statistics_equal_independent_reference(spec):
    """Measured: grads <= 1.2e-7 from the reference (the router losses move them by 1.6e-2,
    8.7e-3 with capacity; megatron's own per-token scaling, without the step's coefficients,
    is 0.73 off); metrics <= 1.2e-7 relative; token counts and dropped tokens exact (88 dropped
    assignments at capacity factor 0.5)."""
    ref = run_on_ranks(reference_rank, 1, spec, timeout=120)[0]
    got = run_on_ranks(step_rank, 2, spec, timeout=120)
    assert max_grad_diff(ref["off"]["grads"], ref["grads"]) > 5e-3  # the losses matter
    for rank in got:
        assert max_grad_diff(rank["grads"], ref["grads"]) < 1e-6
        moe = {k: v for k, v in rank["metrics"].items() if k.startswith("moe/")}
        assert moe == pytest.approx(ref["metrics"], rel=1e-6, abs=0)
    assert got[0]["metrics"] == got[1]["metrics"]
    assert got[0]["grad_norm"] == pytest.approx(got[1]["grad_norm"], abs=0)
    if spec.capacity is not None:
        assert ref["metrics"]["moe/dropped_tokens"] > 0


def _assert_same_run(a: dict, b: dict, tol: float) -> None:
    """Equal per-step grad norms and every logged metric (router statistics included)."""
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], abs=tol, rel=0)
    for mine, theirs in zip(a["metrics"], b["metrics"], strict=True):
        skip = {"step_time", "tokens_per_sec", "samples_per_sec"}  # wall-clock
        keys = set(mine) - skip
        assert keys == set(theirs) - skip
        assert {k: mine[k] for k in keys} == pytest.approx(
            {k: theirs[k] for k in keys}, abs=tol, rel=0
        )


@pytest.mark.parametrize("aux", [0.0, 0.1], ids=["aux-off", "aux-on"])
def test_trainer_grpo_ep2_equals_ep1_and_one_rank(aux):
    """ClippedPG through ``Trainer(strategy=MCoreRLStrategy(expert_model_parallel_size=2))``, 2
    steps: EP=2 on 2 ranks (DP=2) equals EP=1 on 2 ranks (DP=2) and EP=1 on ONE rank with the
    whole batch (the router losses are per-microbatch, so DP-invariant; megatron's
    ``global_aux_loss`` would not be: its counts average over the microbatches seen so far).
    Measured: grad norms and metrics <= 2e-7 apart (tolerance 1e-5)."""
    spec = MoESpec(aux=aux, z=0.01 if aux else None)
    ep2 = run_on_ranks(fit_moe_rank, 2, replace(spec, ep=2), 2, timeout=120)
    ep1 = run_on_ranks(fit_moe_rank, 2, spec, 2, timeout=120)
    one = run_on_ranks(fit_moe_rank, 1, spec, 2, timeout=120)[0]
    assert "train_moe/tokens_per_expert_max" in ep2[0]["metrics"][-1]
    assert ("train_moe/load_balancing_loss" in ep2[0]["metrics"][-1]) == bool(aux)
    _assert_same_run(ep2[0], ep2[1], 0.0)  # identical on every rank
    _assert_same_run(ep2[0], ep1[0], 1e-5)
    _assert_same_run(ep2[0], one, 1e-5)


def test_bad_moe_layouts_raise_at_setup():
    """Refused before any step, on every rank, naming the field: 3 experts over EP=2 (megatron's
    bare MoELayer assertion, re-raised as ValueError), MoE under TP=2 without sequence
    parallelism (megatron only warns at build time and raises in the first training forward),
    the allgather dispatcher under EP=2 (it needs equal token counts per rank) and full
    recompute (the routers would run twice per microbatch)."""
    experts = run_on_ranks(fit_error_rank, 2, MoESpec(ep=2, experts=3), timeout=120)
    no_sp = run_on_ranks(
        fit_error_rank, 2, MoESpec(tp=2, ep=2, sequence_parallel=False), timeout=120
    )
    for err in experts:
        assert err.startswith("ValueError: `build_chunk`: megatron's MoELayer refused")
        assert "`TransformerConfig.num_moe_experts` must be divisible by" in err
    for err in no_sp:
        assert err.startswith("ValueError: Model chunk 0: MoE layers with")
        assert "need `sequence_parallel=True`" in err
    allgather = (("moe_token_dispatcher_type", "allgather"),)
    recompute = (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                 ("recompute_num_layers", 1))  # fmt: skip
    for overrides, message in (
        (allgather, "`TransformerConfig.moe_token_dispatcher_type='allgather'` gathers equal"),
        (recompute, "`TransformerConfig.recompute_granularity='full'` recomputes the MoE"),
    ):
        spec = MoESpec(ep=2, overrides=overrides)
        for err in run_on_ranks(fit_error_rank, 2, spec, timeout=120):
            assert err.startswith(f"ValueError: Model chunk 0: {message}"), err
