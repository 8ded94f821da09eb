"""ClippedPGLossFn over every option: gradcheck, masking, microbatch invariance, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _helpers import DT, check_invariance, counts, random_logprobs, random_pg_batch

from lightning_mcore_rl.losses import ClippedPGLossFn

NO_KL = {"reference_policy_kl_penalty": 0.0}
IS = {"use_importance_sampling_correction": True}
SEQ = {"token_level_loss": False}

# Options whose loss is an ordinary function of the current logprobs (gradcheck applies).
DIFFERENTIABLE: dict[str, dict[str, Any]] = {
    "ppo": NO_KL,
    "asymmetric_dual_clip": {
        **NO_KL,
        "ratio_clip_min": 0.1,
        "ratio_clip_max": 0.3,
        "ratio_clip_c": 1.5,
    },
    "seq_mean_token_mean": {**NO_KL, **SEQ},
    "seq_mean_token_sum": {**NO_KL, "loss_aggregation": "seq_mean_token_sum"},
    "seq_mean_token_sum_norm": {
        **NO_KL,
        "loss_aggregation": "seq_mean_token_sum_norm",
        "loss_aggregation_constant": 8.0,
    },
    "gspo": {**NO_KL, **SEQ, "sequence_level_importance_ratios": True},
    "gspo_is": {**NO_KL, **SEQ, **IS, "sequence_level_importance_ratios": True},
    "reinforce": {**NO_KL, "disable_ppo_ratio": True},
    "kl_k1_on_policy": {
        "reference_policy_kl_penalty": 0.1,
        "reference_policy_kl_type": "k1",
        "use_on_policy_kl_approximation": True,
    },
    "kl_k2_on_policy": {
        "reference_policy_kl_penalty": 0.1,
        "reference_policy_kl_type": "k2",
        "use_on_policy_kl_approximation": True,
    },
    "kl_k3_on_policy_seq": {
        **SEQ,
        "reference_policy_kl_penalty": 0.1,
        "use_on_policy_kl_approximation": True,
    },
    "is": {**NO_KL, **IS},
    "tis": {
        **NO_KL,
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
    },
    "icepop": {
        **NO_KL,
        **IS,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.3,
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "seq_mask_tis": {
        **NO_KL,
        **IS,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "vapo": {**NO_KL, "positive_example_nll_weight": 0.3},
    "entropy_bonus": {**NO_KL, "entropy_coef": 0.05},
    "entropy_bonus_dr_grpo": {
        "entropy_coef": 0.05,
        "reference_policy_kl_penalty": 0.1,
        "use_on_policy_kl_approximation": True,
        "loss_aggregation": "seq_mean_token_sum_norm",
        "loss_aggregation_constant": 8.0,
    },
}
# Options with deliberate stop-gradients (score-function KL weight, CISPO, ratio forced to 1).
STOP_GRADIENT: dict[str, dict[str, Any]] = {
    "default_kl_k3": {},
    "cispo": {**NO_KL, "use_cispo": True},
    "force_on_policy": {**NO_KL, "force_on_policy_ratio": True},
}
ALL = {**DIFFERENTIABLE, **STOP_GRADIENT}


def _inputs(cfg: dict[str, Any], data: dict[str, torch.Tensor], c: torch.Tensor):
    """Loss inputs for ``cfg``: an entropy tensor when the bonus is on."""
    if cfg.get("entropy_coef", 0) > 0:
        return {"next_token_logprobs": c, "entropy": (0.5 - c).detach().requires_grad_(True)}
    return {"next_token_logprobs": c}


@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_gradcheck(name: str) -> None:
    """float64 gradcheck of d loss / d next_token_logprobs (and d / d entropy) for each option."""
    cfg = DIFFERENTIABLE[name]
    data = random_pg_batch()
    c = random_logprobs(data)
    inputs = _inputs(cfg, data, c)
    seqs, toks = counts(data)
    loss_fn = ClippedPGLossFn(cfg)
    keys = list(inputs)

    def f(*tensors: torch.Tensor) -> torch.Tensor:
        return loss_fn(data, seqs, toks, **dict(zip(keys, tensors, strict=True)))[0]

    assert torch.autograd.gradcheck(f, tuple(inputs.values()))


@pytest.mark.parametrize("name", sorted(STOP_GRADIENT))
def test_stop_gradient_closed_forms(name: str) -> None:
    """Stop-gradient options against their closed-form gradients on random data (gradcheck's
    numerical Jacobian would also move the stopped values, so it does not apply):
    score-function KL (k3, w = 1): beta * (-r) * m / N_t with r = ref - c (clamps inactive);
    CISPO: -A * clip(r) * m / N_t; force_on_policy: -A * m / N_t (ratio 1, never clipped)."""
    cfg = STOP_GRADIENT[name]
    data = random_pg_batch()
    c = random_logprobs(data)
    seqs, toks = counts(data)
    loss, _ = ClippedPGLossFn(cfg)(data, seqs, toks, next_token_logprobs=c)
    loss.backward()
    m = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    adv, prev = data["advantages"][:, 1:], data["prev_logprobs"][:, 1:]
    cd = c.detach()
    if name == "default_kl_k3":
        ratio = torch.exp(cd - prev)
        clipped = ratio.clamp(0.8, 1.2)
        active = (-adv * ratio >= -adv * clipped).to(DT)  # unclipped branch carries gradient
        expected = -adv * ratio * active + 0.01 * (cd - data["reference_policy_logprobs"][:, 1:])
    elif name == "cispo":
        expected = -adv * torch.exp(cd - prev).clamp(0.8, 1.2)
    else:
        expected = -adv
    torch.testing.assert_close(c.grad, expected * m / toks, rtol=1e-6, atol=1e-9)


def _garbage(data: dict[str, torch.Tensor], c: torch.Tensor, seed: int = 7):
    """Replace every masked entry of every per-token field (and c) with random junk."""
    g = torch.Generator().manual_seed(seed)
    valid = (data["token_mask"] * data["sample_mask"].unsqueeze(-1)).bool()
    out = dict(data)
    for key in ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        junk = -5 * torch.rand(data[key].shape, generator=g, dtype=DT)
        out[key] = torch.where(valid, data[key], junk)
    out["rewards"] = torch.where(data["sample_mask"].bool(), data["rewards"], 3.0)
    junk_c = -5 * torch.rand(c.shape, generator=g, dtype=DT)
    return out, torch.where(valid[:, 1:], c.detach(), junk_c).requires_grad_(True)


@pytest.mark.parametrize("name", sorted(ALL))
def test_masked_entries_have_no_effect(name: str) -> None:
    """Junk at masked tokens and masked samples changes neither loss, metrics nor gradient, and
    the gradient at masked positions is exactly 0."""
    cfg = ALL[name]
    data = random_pg_batch()
    seqs, toks = counts(data)
    loss_fn = ClippedPGLossFn(cfg)
    results = []
    c0 = random_logprobs(data)
    for d, c in ((data, c0), _garbage(data, c0)):
        inputs = _inputs(cfg, d, c)
        loss, metrics = loss_fn(d, seqs, toks, **inputs)
        loss.backward()
        results.append((loss, metrics, c.grad))
    (l1, m1, g1), (l2, m2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-12)
    for key in m1:
        torch.testing.assert_close(m1[key], m2[key], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    invalid = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)) == 0
    assert (g2[invalid] == 0).all()


@pytest.mark.parametrize("name", sorted(ALL))
def test_all_masked_batch_is_exactly_zero(name: str) -> None:
    """sample_mask = 0 everywhere, counts 0: loss exactly 0 (not NaN), zero gradient, metrics
    finite except the +-inf extrema sentinels."""
    cfg = ALL[name]
    data = random_pg_batch()
    data["sample_mask"] = torch.zeros_like(data["sample_mask"])
    c = random_logprobs(data)
    loss, metrics = ClippedPGLossFn(cfg)(data, 0, 0, **_inputs(cfg, data, c))
    loss.backward()
    assert loss.item() == 0.0
    assert (c.grad == 0).all()
    for key, value in metrics.items():
        assert torch.isfinite(value) or key.endswith(("_min", "_max")), key


@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(ALL))
def test_microbatch_invariance(name: str, num_microbatches: int) -> None:
    """Per-microbatch losses with global counts sum to the whole-batch loss; metrics combined by
    their normaliser (and rescaled from placeholder counts) equal the whole-batch metrics."""
    cfg = ALL[name]
    data = random_pg_batch(batch=4, width=7, seed=3)
    c = random_logprobs(data, seed=4)
    seqs, toks = counts(data)
    check_invariance(
        ClippedPGLossFn(cfg), data, _inputs(cfg, data, c), num_microbatches, seqs, toks
    )


BAD_INPUTS = [
    ("advantages", lambda d, c: d.pop("advantages"), "missing the key `advantages`"),
    ("prev", lambda d, c: d.pop("prev_logprobs"), "missing the key `prev_logprobs`"),
    ("sample_mask", lambda d, c: d.pop("sample_mask"), "missing the key `sample_mask`"),
    ("ref", lambda d, c: d.pop("reference_policy_logprobs"), "`reference_policy_logprobs`"),
    (
        "adv_shape",
        lambda d, c: d.update(advantages=d["advantages"][:, :-1]),
        r"`advantages` must have shape \[4, 6\], got \[4, 5\]",
    ),
    (
        "nan_adv",
        lambda d, c: d["advantages"].__setitem__((1, 2), float("nan")),
        r"`advantages` contains NaN in sample rows \[1\]",
    ),
    (
        "mask_width",
        lambda d, c: d.update(token_mask=d["token_mask"][:, :-1]),
        r"`token_mask` must have shape \[4, 6\], got \[4, 5\]",
    ),
    (
        "adv_type",
        lambda d, c: d.update(advantages=[0.0] * 4),
        "`advantages` must be a torch.Tensor, got list",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "match"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises(name: str, mutate: Any, match: str) -> None:
    """Missing keys, shape mismatches, wrong types and NaN advantages raise clear errors."""
    data = random_pg_batch()
    c = random_logprobs(data)
    mutate(data, c)
    error = TypeError if name == "adv_type" else ValueError
    with pytest.raises(error, match=match):
        ClippedPGLossFn()(data, 3.0, 10.0, next_token_logprobs=c)


def test_bad_loss_inputs_raise() -> None:
    """Wrong logprob shapes, a missing entropy or missing rewards raise naming the input."""
    data = random_pg_batch()
    c = random_logprobs(data)
    with pytest.raises(ValueError, match=r"`next_token_logprobs` must be \[B, S-1\]"):
        ClippedPGLossFn()(data, 3.0, 10.0, next_token_logprobs=c[0])
    with pytest.raises(ValueError, match=r"`token_mask` must have shape \[4, 5\]"):
        ClippedPGLossFn()(data, 3.0, 10.0, next_token_logprobs=c[:, :-1])
    with pytest.raises(ValueError, match="needs the `entropy` loss input"):
        ClippedPGLossFn({"entropy_coef": 0.1})(data, 3.0, 10.0, next_token_logprobs=c)
    with pytest.raises(ValueError, match=r"`entropy` must have shape \[4, 5\]"):
        ClippedPGLossFn({"entropy_coef": 0.1})(
            data, 3.0, 10.0, next_token_logprobs=c, entropy=c[:, :-1]
        )
    data.pop("rewards")
    with pytest.raises(ValueError, match="missing the key `rewards`"):
        ClippedPGLossFn({"positive_example_nll_weight": 0.1})(
            data, 3.0, 10.0, next_token_logprobs=c
        )
