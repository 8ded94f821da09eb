"""Acceptance tests of ``MCoreRLModule``'s post-processing hooks and forward-only passes.

Every forward-only output is compared, on every rank, with plain torch ops on the logits / final
hidden states of the same layout-invariant tiny GPT built at TP=1 and called directly (eval mode,
no schedule, no post-processor). One spawned run per layout (TP=2, PP=2 with dropout, the GRPO
recipe); the tests below read its results.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from _hook_runs import (
    LOSS_SCALE,
    OVERRIDE_K,
    OVERRIDE_TEMPERATURE,
    TEMPERATURE,
    TOP_K,
    K,
    ScaledLoss,
    grpo_scope_rank,
    pp_dropout_rank,
    tp_hooks_rank,
)
from torch import Tensor

from lightning_mcore_rl.testing import run_on_ranks

TOL = 1e-5


def reference_logprobs(
    logits: Tensor, ids: Tensor, temperature: float, top_k: int | None = None
) -> Tensor:
    """Stored-convention ``[B, S]`` logprobs (0 at position 0) of ``log_softmax(logits / T)``,
    optionally top-k filtered (ties kept); a filtered-out next token reads 0."""
    z = logits / temperature
    if top_k is not None:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    picked = z.log_softmax(dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    picked = F.pad(picked, (1, 0))
    return picked.masked_fill(picked.isneginf(), 0.0)


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def tp_runs():
    return run_on_ranks(tp_hooks_rank, 2, timeout=120)


@pytest.fixture(scope="module")
def pp_runs():
    return run_on_ranks(pp_dropout_rank, 2, timeout=120)


@pytest.fixture(scope="module")
def grpo_runs():
    # emulate_cuda=False: the rank itself never enters the CPU backend, only the strategy does
    (runs,) = run_on_ranks(grpo_scope_rank, 1, (1.0, TEMPERATURE), timeout=120, emulate_cuda=False)
    return {run.temperature: run for run in runs}


# ---------------------------------------------------------------- 1. temperature


@pytest.mark.parametrize("layout", ["tp", "pp"], ids=["tp2", "pp2"])
def test_compute_logprobs_applies_the_temperature_once(layout, request):
    runs = request.getfixturevalue(f"{layout}_runs")
    for run in runs:
        ref = run.reference.logits
        got = run.probes["logprobs"]
        assert got.shape == run.ids.shape and torch.all(got[:, 0] == 0)
        diff = max_diff(got, reference_logprobs(ref, run.ids, TEMPERATURE))
        print(f"{layout}: compute_logprobs vs log_softmax(logits / 2): max diff {diff:.2e}")
        assert diff <= TOL
        # discriminating: not T=1 (never applied) and not T=4 (applied twice)
        for wrong in (1.0, TEMPERATURE**2):
            assert max_diff(got, reference_logprobs(ref, run.ids, wrong)) > 1e-2


# ---------------------------------------------------------------- 2. GRPO recipe


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_grpo_on_policy_step_has_unit_token_mult_prob_error(grpo_runs, temperature):
    run = grpo_runs[temperature]
    assert run.global_step == 1
    error = run.metrics["train_token_mult_prob_error"]
    print(f"GRPO T={temperature}: train_token_mult_prob_error - 1 = {error - 1:.2e}")
    assert error == pytest.approx(1.0, abs=TOL)


# ---------------------------------------------------------------- 3. each hook overridden


def test_sampling_params_override_sets_the_temperature(tp_runs):
    for run in tp_runs:
        got = run.probes["sampling_override"]
        ref = run.reference.logits
        diff = max_diff(got, reference_logprobs(ref, run.ids, OVERRIDE_TEMPERATURE))
        print(f"sampling_params() -> T=0.5: max diff {diff:.2e}")
        assert diff <= TOL
        # the override, not the constructor's T=2
        assert max_diff(got, reference_logprobs(ref, run.ids, TEMPERATURE)) > 1e-2


def test_loss_post_processor_override_scales_loss_and_grad_norm(tp_runs):
    # Step 0: default hook; step 1 (lr = 0: same weights, same batch): the loss and its logged
    # value times 3. d(3L) = 3 dL, so grad_norm (pre-clip L2 norm) and train_loss triple; every
    # other metric is unchanged.
    for run in tp_runs:
        default, scaled = run.rows
        assert run.global_step == 2
        for key in ("train_loss", "grad_norm"):
            ratio = scaled[key] / default[key]
            print(f"loss_post_processor x3: {key} ratio {ratio:.8f}")
            assert default[key] > 0 and ratio == pytest.approx(LOSS_SCALE, rel=1e-6)
        others = {k for k in default if k.startswith("train_") and k != "train_loss"}
        assert "train_token_mult_prob_error" in others
        assert {k: scaled[k] for k in others} == {k: default[k] for k in others}
    for step in range(2):  # identical on both TP ranks
        for key in ("train_loss", "grad_norm"):
            assert tp_runs[0].rows[step][key] == tp_runs[1].rows[step][key]


def test_loss_post_processor_old_style_override_trains_and_takes_m(tp_runs):
    # ScaledLoss overrides `loss_post_processor(self, num_microbatches)` with the argument
    # required: the strategy's positional `(None)` call trains step 1 with it (the x3 ratio
    # above), and an int builds a post-processor for exactly that M.
    required = inspect.signature(ScaledLoss.loss_post_processor).parameters["num_microbatches"]
    assert required.default is inspect.Parameter.empty
    for run in tp_runs:
        assert run.rows[1]["train_loss"] == pytest.approx(LOSS_SCALE * run.rows[0]["train_loss"])
        assert run.probes["loss_m"] == {"default": None, "default_4": 4, "override_4": 4}


def test_logprobs_post_processor_override_filters_top_k(tp_runs):
    for run in tp_runs:
        got = run.probes["logprobs_override"]
        ref = run.reference.logits
        filtered = reference_logprobs(ref, run.ids, TEMPERATURE, top_k=TOP_K)
        diff = max_diff(got, filtered)
        print(f"logprobs_post_processor top_k={TOP_K}: max diff {diff:.2e}")
        assert diff <= TOL
        survivors = filtered[:, 1:] != 0
        plain = reference_logprobs(ref, run.ids, TEMPERATURE)
        # both kinds of position occur, and kept tokens are renormalised over the top-k
        assert 0 < int(survivors.sum()) < survivors.numel()
        assert torch.all(got[:, 1:][survivors] > plain[:, 1:][survivors] + 1e-3)


def _untied(values: Tensor, k: int) -> Tensor:
    """``[..., k]`` True where the j-th largest value is separated (> TOL) from its neighbours."""
    gaps = values[..., :-1] - values[..., 1:]  # [..., k] for k + 1 values
    above = torch.cat([torch.full_like(gaps[..., :1], math.inf), gaps[..., :-1]], dim=-1)
    return (gaps[..., :k] > TOL) & (above[..., :k] > TOL)


@pytest.mark.parametrize(("probe", "k"), [("topk", K), ("topk_override", OVERRIDE_K)])
def test_compute_topk_logits_matches_torch_topk(tp_runs, probe, k):
    # "topk_override": topk_logits_post_processor(k) returns a k=7 processor whatever k is asked
    for run in tp_runs:
        values, indices = run.probes[probe]
        scaled = run.reference.logits / TEMPERATURE  # temperature applies to every output
        ref_values, ref_indices = scaled.topk(k + 1, dim=-1)
        assert values.shape == indices.shape == (*run.ids.shape, k)
        diff = max_diff(values, ref_values[..., :k])
        print(f"{probe} (k={k}): values max diff {diff:.2e}")
        assert diff <= TOL
        untied = _untied(ref_values, k)
        assert untied.float().mean() > 0.9
        assert torch.equal(indices[untied], ref_indices[..., :k][untied])


def test_teacher_payload_logits_and_hidden_states(tp_runs, pp_runs):
    for run in tp_runs:
        ref = run.reference
        lp, logits = run.probes["payload_logits"]
        assert logits.dtype == torch.float32
        d_logits = max_diff(logits, ref.logits / TEMPERATURE)
        lp_h, hidden = run.probes["payload_hidden"]
        d_hidden = max_diff(hidden, ref.hidden)
        # the reference hidden states are the output layer's input (no bias): W h = logits
        assert max_diff(ref.hidden @ ref.output_weight.T, ref.logits) <= TOL
        expected_lp = reference_logprobs(ref.logits, run.ids, TEMPERATURE)
        d_lp = max(max_diff(lp, expected_lp), max_diff(lp_h, expected_lp))
        print(f"teacher payload tp2: logits {d_logits:.2e}, hidden {d_hidden:.2e}, lp {d_lp:.2e}")
        assert max(d_logits, d_hidden, d_lp) <= TOL
    for run in pp_runs:  # broadcast from the last stage to the first
        _, logits = run.probes["payload_logits"]
        d_pp = max_diff(logits, run.reference.logits / TEMPERATURE)
        print(f"teacher payload pp2: logits {d_pp:.2e}")
        assert d_pp <= TOL


def test_teacher_payload_post_processor_override(tp_runs):
    # the override returns bf16 payloads and top-k filtered logprobs for any request
    for run in tp_runs:
        ref = run.reference.logits
        lp, logits = run.probes["payload_override"]
        assert logits.dtype == torch.bfloat16
        expected = (ref / TEMPERATURE).to(torch.bfloat16)
        d_payload = max_diff(logits, expected)
        d_lp = max_diff(lp, reference_logprobs(ref, run.ids, TEMPERATURE, top_k=TOP_K))
        print(f"teacher_payload_post_processor: bf16 payload {d_payload:.2e}, lp {d_lp:.2e}")
        assert d_payload <= 2**-8 * expected.float().abs().max().item()  # one bf16 ulp
        assert d_lp <= TOL


# ---------------------------------------------------------------- 4. dropout


def test_forward_only_runs_without_dropout_and_restores_train_mode(pp_runs):
    # hidden_dropout = attention_dropout = 0.5, probed from training_step (train mode)
    first_stage = [run for run in pp_runs if run.probes["dropout_active"] is not None]
    assert len(first_stage) == 1 and first_stage[0].probes["dropout_active"]
    for run in pp_runs:
        probes = run.probes
        assert probes["flags_before"] and all(flag for _, flag in probes["flags_before"])
        assert probes["flags_after"] == probes["flags_before"]
        assert torch.equal(probes["logprobs"], probes["logprobs_again"])
        # the eval-mode reference: the same model (dropout 0.5) after .eval()
        diff = max_diff(
            probes["logprobs"], reference_logprobs(run.reference.logits, run.ids, TEMPERATURE)
        )
        print(f"dropout 0.5, train mode: compute_logprobs vs eval reference {diff:.2e}")
        assert diff <= TOL


# ---------------------------------------------------------------- 5. CPU backend scope


def test_cpu_backend_is_scoped_to_fit(grpo_runs):
    for run in grpo_runs.values():
        assert not run.active_before
        assert run.active_inside == [True]
        assert not run.active_after
        assert run.current_device_restored
