"""ClippedPGLossFn: hand-derived values, gradients, masking and microbatch invariance.

Hand-sized batches give every field as its ``[B, S-1]`` loss-aligned part; ``full_width``
prepends the position-0 column the loss drops. ``N_t``/``N_s`` are the valid token/sequence
counts of the whole batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _helpers import (
    counts,
    full_width,
    random_logprobs,
    random_pg_batch,
    t,
)

from lightning_mcore_rl.losses import ClippedPGLossFn, LossFunction, LossType

LN = math.log


def pg_data(
    adv: list[list[float]],
    prev: list[list[float]],
    gen: list[list[float]] | None = None,
    ref: list[list[float]] | None = None,
    tm: list[list[float]] | None = None,
    sm: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """A batch from loss-aligned rows; ``gen``/``ref`` default to ``prev``, masks to ones."""
    ones = [[1.0] * len(adv[0]) for _ in adv]
    return {
        "advantages": full_width(adv),
        "prev_logprobs": full_width(prev),
        "generation_logprobs": full_width(gen or prev),
        "reference_policy_logprobs": full_width(ref or prev),
        "token_mask": full_width(tm or ones),
        "sample_mask": t(sm or [1.0] * len(adv)),
    }


def run(cfg: dict[str, Any], data: dict[str, torch.Tensor], curr: list[list[float]], **extra: Any):
    """Loss, metrics and gradient w.r.t. the current logprobs, with whole-batch counts."""
    c = t(curr).requires_grad_(True)
    seqs, toks = counts(data)
    loss, metrics = ClippedPGLossFn(cfg)(data, seqs, toks, next_token_logprobs=c, **extra)
    loss.backward()
    return loss.item(), {k: float(v) for k, v in metrics.items()}, c.grad


NO_KL = {"reference_policy_kl_penalty": 0.0}


def assert_grad(grad: torch.Tensor | None, expected: list[list[float]]) -> None:
    """The gradient equals the hand-derived one (float64, tight tolerance)."""
    assert grad is not None
    torch.testing.assert_close(grad, t(expected), rtol=1e-7, atol=1e-10)


def test_ppo_symmetric_clip() -> None:
    """prev = -1, ratios r = [1.5, 0.5, 1], A = [1, -1, 2], eps = 0.2:
    t1: max(-1.5, -1.2) = -1.2 (clipped high, no grad); t2: max(0.5, 0.8) = 0.8 (clipped low);
    t3: -2. loss = (-1.2 + 0.8 - 2) / 3 = -0.8. grad = [0, 0, -A r / 3 = -2/3].
    clip fractions: low 1/3, high 1/3, total 2/3; ratio mean (1.5+0.5+1)/3 = 1, clamped mean 1."""
    data = pg_data([[1.0, -1.0, 2.0]], [[-1.0] * 3])
    loss, m, grad = run(NO_KL, data, [[-1 + LN(1.5), -1 + LN(0.5), -1.0]])
    assert loss == pytest.approx(-0.8)
    assert_grad(grad, [[0.0, 0.0, -2 / 3]])
    assert m["clip_fraction_low"] == pytest.approx(1 / 3)
    assert m["clip_fraction_high"] == pytest.approx(1 / 3)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["dual_clip_fraction"] == 0.0
    assert m["probs_ratio"] == pytest.approx(1.0) and m["probs_ratio_clamped"] == pytest.approx(1.0)
    assert (m["probs_ratio_min"], m["probs_ratio_max"]) == pytest.approx((0.5, 1.5))
    assert (m["probs_ratio_clamped_min"], m["probs_ratio_clamped_max"]) == pytest.approx((0.8, 1.2))
    assert m["token_mult_prob_error"] == pytest.approx(1.0) and m["gen_kl_error"] == 0.0
    assert m["kl_penalty"] == 0.0 and m["num_valid_samples"] == 1.0
    assert m["loss"] == pytest.approx(loss)


def test_asymmetric_clip() -> None:
    """Same tokens, eps_low = 0.1, eps_high = 0.6: t1 r=1.5 < 1.6 unclipped -> -1.5;
    t2 clamp(0.5) = 0.9 -> max(0.5, 0.9) = 0.9; t3 -2. loss = (-1.5 + 0.9 - 2)/3."""
    cfg = {**NO_KL, "ratio_clip_min": 0.1, "ratio_clip_max": 0.6}
    data = pg_data([[1.0, -1.0, 2.0]], [[-1.0] * 3])
    loss, m, grad = run(cfg, data, [[-1 + LN(1.5), -1 + LN(0.5), -1.0]])
    assert loss == pytest.approx(-2.6 / 3)
    assert_grad(grad, [[-1.5 / 3, 0.0, -2 / 3]])
    assert m["clip_fraction_high"] == 0.0 and m["clip_fraction_low"] == pytest.approx(1 / 3)


def test_dual_clip() -> None:
    """c = 3, A = [-1, -1], r = [4, 2]: t1 max(4, 1.2) = 4 -> min(4, 3) = 3 (dual, no grad);
    t2 max(2, 1.2) = 2 < 3 -> 2, grad -A r / 2 = 1. loss 2.5, dual fraction 1/2."""
    data = pg_data([[-1.0, -1.0]], [[-2.0, -2.0]])
    loss, m, grad = run({**NO_KL, "ratio_clip_c": 3.0}, data, [[-2 + LN(4), -2 + LN(2)]])
    assert loss == pytest.approx(2.5)
    assert_grad(grad, [[0.0, 1.0]])
    assert m["dual_clip_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        # per-token loss = -A (ratio 1); sample 0: [-1, -2, -3], sample 1: [-4] (1 valid token)
        ({"token_level_loss": True}, (-6 - 4) / 4),
        ({"token_level_loss": False}, (-2 - 4) / 2),
        ({"loss_aggregation": "seq_mean_token_mean"}, (-2 - 4) / 2),
        ({"loss_aggregation": "seq_mean_token_sum"}, (-6 - 4) / 2),
        (
            {"loss_aggregation": "seq_mean_token_sum_norm", "loss_aggregation_constant": 10.0},
            (-6 - 4) / (2 * 10),
        ),
    ],
)
def test_loss_aggregation(cfg: dict[str, Any], expected: float) -> None:
    """Ratio 1 (c = prev) so each token contributes -A; see the parameter comments."""
    data = pg_data([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]], [[-1.0] * 3] * 2, tm=[[1, 1, 1], [1, 0, 0]])
    loss, m, _ = run({**NO_KL, **cfg}, data, [[-1.0] * 3] * 2)
    assert loss == pytest.approx(expected)


def test_gspo_sequence_ratio() -> None:
    """Log-ratios [0.1, 0.3] -> r = exp(0.2) = 1.2214 for both tokens; A = -1:
    max(1.2214, 1.2) = 1.2214 per token, seq mean = r. d r / d c_t = r / 2 -> grad [r/2, r/2].
    With A = +1 the clipped side wins: loss -1.2 and zero gradient."""
    cfg = {**NO_KL, "token_level_loss": False, "sequence_level_importance_ratios": True}
    r = math.exp(0.2)
    loss, m, grad = run(cfg, pg_data([[-1.0, -1.0]], [[-1.0, -1.0]]), [[-0.9, -0.7]])
    assert loss == pytest.approx(r)
    assert_grad(grad, [[r / 2, r / 2]])
    loss, m, grad = run(cfg, pg_data([[1.0, 1.0]], [[-1.0, -1.0]]), [[-0.9, -0.7]])
    assert loss == pytest.approx(-1.2)
    assert_grad(grad, [[0.0, 0.0]])
    assert m["clip_fraction_high"] == pytest.approx(1.0)


def test_cispo() -> None:
    """CISPO: loss_t = -A sg(clip(r)) c. prev = -1, r = [1.5, 0.5], A = [1, -1]:
    t1: -1 * 1.2 * (-1 + ln 1.5); t2: +1 * 0.8 * (-1 + ln 0.5). Mean over 2.
    Gradient is -A clip(r) / 2 = [-0.6, 0.4] (clipped tokens keep a gradient, unlike PPO)."""
    c = [[-1 + LN(1.5), -1 + LN(0.5)]]
    loss, m, grad = run({**NO_KL, "use_cispo": True}, pg_data([[1.0, -1.0]], [[-1.0] * 2]), c)
    assert loss == pytest.approx((-1.2 * c[0][0] + 0.8 * c[0][1]) / 2)
    assert_grad(grad, [[-0.6, 0.4]])
    assert m["clip_fraction"] == pytest.approx(1.0)


def test_reinforce() -> None:
    """disable_ppo_ratio: loss = mean(-A c) with A = [1, -2], c = [-0.5, -1]:
    (0.5 - 2) / 2 = -0.75; grad -A / 2 = [-0.5, 1]. No clip fractions."""
    cfg = {**NO_KL, "disable_ppo_ratio": True}
    loss, m, grad = run(cfg, pg_data([[1.0, -2.0]], [[-3.0, -3.0]]), [[-0.5, -1.0]])
    assert loss == pytest.approx(-0.75)
    assert_grad(grad, [[-0.5, 1.0]])
    assert m["clip_fraction"] == 0.0


def test_force_on_policy_ratio_needs_no_prev() -> None:
    """force_on_policy_ratio: r = exp(c - sg(c)) = 1, so loss = mean(-A) = (-1 + 2)/2 = 0.5 and
    grad = -A r / 2 = [-0.5, 1]; prev_logprobs is not read. The sampler mismatch extremes come
    from c: exp(c - g) = exp(-0.5 + 3), exp(-1 + 3)."""
    data = pg_data([[1.0, -2.0]], [[-3.0, -3.0]])
    del data["prev_logprobs"]
    loss, m, grad = run({**NO_KL, "force_on_policy_ratio": True}, data, [[-0.5, -1.0]])
    assert loss == pytest.approx(0.5)
    assert_grad(grad, [[-0.5, 1.0]])
    assert m["probs_ratio"] == pytest.approx(1.0)
    assert m["gen_train_ratio_min"] == pytest.approx(math.exp(2.0), rel=1e-12)
    assert m["gen_train_ratio_max"] == pytest.approx(math.exp(2.5), rel=1e-12)


K3 = [math.exp(-0.5) - 0.5, math.e - 2.0]


@pytest.mark.parametrize(
    ("kl_type", "values", "grads"),
    [
        # r = ref - c = [-0.5, 1], w = exp(c - sg(c)) = 1, d/dc (w k) = k + dk/dc
        ("k1", [0.5, -1.0], [0.5 + 1, -1 + 1]),  # dk1/dc = 1
        ("k2", [0.125, 0.5], [0.125 + 0.5, 0.5 - 1]),  # dk2/dc = -r
        ("k3", K3, [0.5, -1.0]),  # k3 + 1 - e^r = -r
    ],
)
def test_reference_kl_penalty(kl_type: str, values: list[float], grads: list[float]) -> None:
    """A = 0 isolates the KL: c = [-1, -2], ref = [-1.5, -1], beta = 0.1, N_t = 2.
    loss = beta * mean(k); grad = beta * (k + dk/dc) / 2; kl_penalty metric = loss / beta."""
    cfg = {"reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": kl_type}
    data = pg_data([[0.0, 0.0]], [[-1.0, -2.0]], ref=[[-1.5, -1.0]])
    loss, m, grad = run(cfg, data, [[-1.0, -2.0]])
    assert loss == pytest.approx(0.1 * sum(values) / 2)
    assert_grad(grad, [[0.1 * g / 2 for g in grads]])
    assert m["kl_penalty"] == pytest.approx(sum(values) / 2)


def test_reference_kl_clamps_and_use_kl_in_reward() -> None:
    """Input clamp 0.4 clamps both r = [-0.5, 1]: k3(-0.4) + k3(0.4), gradient 0 (r constant,
    weight detached). Output clamp 0.5: k3(1) = 0.718 -> 0.5, its gradient 0.
    use_kl_in_reward forces beta = 0: loss 0."""
    data = pg_data([[0.0, 0.0]], [[-1.0, -2.0]], ref=[[-1.5, -1.0]])
    base = {"reference_policy_kl_penalty": 0.1}
    loss, _, grad = run({**base, "kl_input_clamp_value": 0.4}, data, [[-1.0, -2.0]])
    assert loss == pytest.approx(0.1 * (math.exp(-0.4) - 0.6 + math.exp(0.4) - 1.4) / 2)
    assert grad.tolist() == [[0.0, 0.0]]
    loss, _, grad = run({**base, "kl_output_clamp_value": 0.5}, data, [[-1.0, -2.0]])
    assert loss == pytest.approx(0.1 * (K3[0] + 0.5) / 2)
    assert_grad(grad, [[0.1 * 0.5 / 2, 0.0]])
    loss, m, _ = run({**base, "use_kl_in_reward": True}, data, [[-1.0, -2.0]])
    assert loss == 0.0 and m["kl_penalty"] == 0.0


def test_on_policy_kl_approximation_and_unfiltered() -> None:
    """w = exp(c_u - g) with g = [-1.5, -2] -> w = [e^0.5, 1]; loss = 0.1 (e^0.5 k3_1 + k3_2)/2.
    The KL reads ``curr_logprobs_unfiltered`` when present (here equal to c, as a tensor
    without grad, so the KL contributes no gradient to c)."""
    cfg = {"reference_policy_kl_penalty": 0.1, "use_on_policy_kl_approximation": True}
    data = pg_data([[0.0, 0.0]], [[-1.0, -2.0]], gen=[[-1.5, -2.0]], ref=[[-1.5, -1.0]])
    loss, _, _ = run(cfg, data, [[-1.0, -2.0]])
    assert loss == pytest.approx(0.1 * (math.exp(0.5) * K3[0] + K3[1]) / 2)
    data["curr_logprobs_unfiltered"] = t([[-1.0, -2.0]])
    loss2, _, grad = run(cfg, data, [[-1.0, -2.0]])
    assert loss2 == pytest.approx(loss) and grad.abs().sum() == 0


IS_PREV = [[-1.0, -1.0, -1.0]]
IS_GEN = [[-1.0 - LN(3.0), -1.0, -1.0 + LN(4.0)]]  # w = exp(prev - gen) = [3, 1, 0.25]


@pytest.mark.parametrize(
    ("tis", "weights", "oob"),
    [
        (None, [3.0, 1.0, 0.25], None),
        ({"truncated_importance_sampling_type": "tis"}, [2.0, 1.0, 0.25], 1 / 3),
        (
            {"truncated_importance_sampling_type": "icepop"}
            | {"truncated_importance_sampling_ratio_min": 0.5},
            [0.0, 1.0, 0.0],
            2 / 3,
        ),
    ],
)
def test_importance_sampling_token_level(
    tis: dict[str, Any] | None, weights: list[float], oob: float | None
) -> None:
    """w = [3, 1, 0.25]; tis clamps to [0, 2]; icepop zeroes outside [0.5, 2]. With c = prev
    (r = 1) and A = 1: loss = -mean(w); sampling_importance_ratio = mean(w)."""
    cfg = {**NO_KL, "use_importance_sampling_correction": True}
    if tis:
        cfg |= {**tis, "truncated_importance_sampling_ratio": 2.0}
    loss, m, grad = run(cfg, pg_data([[1.0] * 3], IS_PREV, gen=IS_GEN), IS_PREV)
    assert loss == pytest.approx(-sum(weights) / 3)
    assert_grad(grad, [[-w / 3 for w in weights]])
    assert m["sampling_importance_ratio"] == pytest.approx(sum(weights) / 3)
    assert m.get("is_oob_ratio") == (None if oob is None else pytest.approx(oob))


def test_seq_mask_tis() -> None:
    """Per-token log-ratios 0.1 (sample 0) and 0.001 (sample 1); geometric means e^0.1 and
    e^0.001; bounds [0.999, 1.002] drop sample 0: is_oob = 1/2. Kept weights e^0.001, A = 1,
    r = 1: loss = -(3 e^0.001) / 6."""
    cfg = {
        **NO_KL,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.002,
        "truncated_importance_sampling_ratio_min": 0.999,
    }
    prev = [[-1.0] * 3] * 2
    gen = [[-1.1] * 3, [-1.001] * 3]
    loss, m, _ = run(cfg, pg_data([[1.0] * 3] * 2, prev, gen=gen), prev)
    assert loss == pytest.approx(-3 * math.exp(0.001) / 6)
    assert m["is_oob_ratio"] == pytest.approx(0.5)


def test_sequence_level_is_weights_and_trap_18() -> None:
    """GSPO + IS: w_i = exp(sum_t (prev - gen)) = [e^0.3, e^0.003]. The metric is
    sum_i w_i sm_i / N_s = (e^0.3 + e^0.003)/2 (the reference's [B,1]*[B] broadcast would give
    (e^0.3 + e^0.003) * 2 / 2). loss with r = 1, A = 1: -(e^0.3 + e^0.003)/2."""
    cfg = {
        **NO_KL,
        "token_level_loss": False,
        "sequence_level_importance_ratios": True,
        "use_importance_sampling_correction": True,
    }
    prev = [[-1.0] * 3] * 2
    gen = [[-1.1] * 3, [-1.001] * 3]
    loss, m, _ = run(cfg, pg_data([[1.0] * 3] * 2, prev, gen=gen), prev)
    w = [math.exp(0.3), math.exp(0.003)]
    assert m["sampling_importance_ratio"] == pytest.approx(sum(w) / 2)
    assert loss == pytest.approx(-sum(w) / 2)


def test_vapo_positive_nll_and_entropy_bonus() -> None:
    """A = 0. VAPO mu = 0.5, rewards [1, 0]: NLL over sample 0's tokens / N_t = (1 + 2)/4 = 0.75,
    loss 0.375, grad -mu/N_t = -0.125 on sample 0 only. Entropy coef 0.1 with H = [0.5, 1.5] on
    one sample: loss -0.1 * 1 = -0.1, dL/dH = -0.05."""
    data = pg_data([[0.0, 0.0]] * 2, [[-1.0, -2.0], [-3.0, -4.0]])
    data["rewards"] = t([1.0, 0.0])
    loss, m, grad = run({**NO_KL, "positive_example_nll_weight": 0.5}, data, [[-1, -2], [-3, -4]])
    assert loss == pytest.approx(0.375) and m["positive_nll_loss"] == pytest.approx(0.75)
    assert_grad(grad, [[-0.125, -0.125], [0.0, 0.0]])
    h = t([[0.5, 1.5]]).requires_grad_(True)
    data = pg_data([[0.0, 0.0]], [[-1.0, -2.0]])
    c = t([[-1.0, -2.0]])
    loss_fn = ClippedPGLossFn({**NO_KL, "entropy_coef": 0.1})
    loss_t, metrics = loss_fn(data, 1.0, 2.0, next_token_logprobs=c, entropy=h)
    loss_t.backward()
    assert loss_t.item() == pytest.approx(-0.1) and metrics["entropy"].item() == pytest.approx(1)
    assert_grad(h.grad, [[-0.05, -0.05]])


def test_approx_entropy_and_diagnostics() -> None:
    """c = gen = prev: approx_entropy = -mean(exp(0) c) = 1.5; token_mult_prob_error = 1;
    gen/policy KL and JS divergence 0."""
    _, m, _ = run(NO_KL, pg_data([[0.0, 0.0]], [[-1.0, -2.0]]), [[-1.0, -2.0]])
    assert m["approx_entropy"] == pytest.approx(1.5)
    assert m["js_divergence_error"] == pytest.approx(0.0, abs=1e-12)
    assert m["policy_kl_error"] == 0.0


def test_protocol_and_normalizer_keys() -> None:
    """Satisfies LossFunction; metric keys equal the declared normalisers for rich configs."""
    cfg = {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
        "entropy_coef": 0.01,
        "token_level_loss": False,
    }
    loss_fn = ClippedPGLossFn(cfg)
    assert isinstance(loss_fn, LossFunction)
    assert loss_fn.loss_type is LossType.SEQUENCE_LEVEL
    data = random_pg_batch()
    c = random_logprobs(data)
    _, metrics = loss_fn(data, 3.0, 10.0, next_token_logprobs=c, entropy=c.detach().neg())
    assert set(metrics) == set(loss_fn.metric_normalizations)
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())
