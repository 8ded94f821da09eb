"""masked_mean, calculate_kl and aggregate: hand-derived values and gradients."""

import math

import pytest
import torch
from _helpers import DT, t

from lightning_mcore_rl.losses import calculate_kl, masked_mean
from lightning_mcore_rl.losses.utils import aggregate, masked_max, masked_min


def test_masked_mean_local_and_global() -> None:
    """values [1, 2, 3, 4], mask [1, 0, 1, 1]: sum 8; local N = 3 -> 8/3; global N = 10 -> 0.8."""
    v, m = t([1.0, 2.0, 3.0, 4.0]), t([1.0, 0.0, 1.0, 1.0])
    assert masked_mean(v, m).item() == pytest.approx(8 / 3)
    assert masked_mean(v, m, global_normalization_factor=10).item() == pytest.approx(0.8)
    assert masked_mean(v, m, global_normalization_factor=torch.tensor(10.0)).item() == (
        pytest.approx(0.8)
    )


def test_masked_mean_dim_and_epsilon() -> None:
    """Rows [[1, 3], [5, 7]] with mask [[1, 1], [0, 0]]: row means 2 and 0/(0+1e-8) = 0."""
    out = masked_mean(t([[1.0, 3.0], [5.0, 7.0]]), t([[1.0, 1.0], [0.0, 0.0]]), dim=-1)
    assert out.tolist() == pytest.approx([2.0 / (1 + 0.5e-8), 0.0])
    assert out[1].item() == 0.0


def test_masked_mean_all_masked_is_zero_with_garbage() -> None:
    """All-zero mask: exactly 0 even with NaN/inf in the masked values, and zero gradient."""
    v = t([float("nan"), float("inf"), 1.0]).requires_grad_(True)
    out = masked_mean(v, t([0.0, 0.0, 0.0]), global_normalization_factor=0)
    assert out.item() == 0.0
    out.backward()
    assert v.grad.tolist() == [0.0, 0.0, 0.0]


def test_masked_min_max_sentinels() -> None:
    """Extrema over valid entries; +inf / -inf when nothing is valid."""
    v, m = t([3.0, -1.0, 2.0]), t([1.0, 0.0, 1.0])
    assert masked_min(v, m).item() == 2.0 and masked_max(v, m).item() == 3.0
    assert masked_min(v, m * 0).item() == math.inf and masked_max(v, m * 0).item() == -math.inf


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [
        # r = ref - lp = [-0.5, 1]
        ("k1", [0.5, -1.0]),  # -r
        ("k2", [0.125, 0.5]),  # r^2 / 2
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),  # e^r - 1 - r
    ],
)
def test_calculate_kl_estimators(kl_type: str, expected: list[float]) -> None:
    """lp = [-1, -2], ref = [-1.5, -1] -> r = [-0.5, 1]; the estimators in the comments."""
    out = calculate_kl(t([-1.0, -2.0]), t([-1.5, -1.0]), kl_type=kl_type)
    assert out.tolist() == pytest.approx(expected)


def test_calculate_kl_clamps() -> None:
    """r = [-0.5, 1]: input clamp 0.4 -> k3(±0.4); output clamp 0.5 caps k3(1) = 0.718 at 0.5."""
    lp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    inp = calculate_kl(lp, ref, "k3", input_clamp_value=0.4, output_clamp_value=None)
    assert inp.tolist() == pytest.approx([math.exp(-0.4) - 0.6, math.exp(0.4) - 1.4])
    out = calculate_kl(lp, ref, "k3", input_clamp_value=None, output_clamp_value=0.5)
    assert out.tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.5])
    raw = calculate_kl(t([0.0]), t([30.0]), "k1", None, None)
    assert raw.item() == -30.0


def test_calculate_kl_clamp_detaches_importance_weight() -> None:
    """w = exp(lp - lp.detach()) (value 1). Unclamped token: d(w k1)/dlp = k1 + 1 = 1.5 for
    r = -0.5. Clamped token (r = 30 > 20): r is constant and w detached -> gradient 0."""
    lp = t([-1.0, -31.0]).requires_grad_(True)
    w = torch.exp(lp - lp.detach())
    out = calculate_kl(lp, t([-1.5, -1.0]), "k1", 20, None, importance_sampling_weights=w)
    out.sum().backward()
    assert lp.grad.tolist() == pytest.approx([1.5, 0.0])


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_calculate_kl_gradcheck(kl_type: str) -> None:
    """float64 gradcheck w.r.t. the logprobs and independent importance weights (clamps off
    the active region). A weight built as ``exp(lp - lp.detach())`` is a stop-gradient construct
    whose numerical Jacobian differs by design; its closed form is checked in the PG tests."""
    ref = t([[-1.2, -0.3, -2.0]])

    def f(lp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return calculate_kl(lp, ref, kl_type, importance_sampling_weights=w)  # type: ignore[arg-type]

    lp = t([[-1.0, -0.5, -1.5]]).requires_grad_(True)
    w = t([[0.5, 1.0, 2.0]]).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (lp, w))


def test_calculate_kl_rejects_unknown_type() -> None:
    """Unknown estimators raise naming the argument."""
    with pytest.raises(ValueError, match="`kl_type` must be one of"):
        calculate_kl(t([0.0]), t([0.0]), kl_type="k4")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # x = [[1, 2, 3], [4, 9, 9]], tm = [[1, 1, 1], [1, 0, 0]], N_t = 4, N_s = 2
        ("token_mean", (1 + 2 + 3 + 4) / 4),
        ("seq_mean_token_mean", (2.0 + 4.0) / 2),
        ("seq_mean_token_sum", (6.0 + 4.0) / 2),
        ("seq_mean_token_sum_norm", (6.0 + 4.0) / (10.0 * 2)),  # C = 10
    ],
)
def test_aggregate_modes(mode: str, expected: float) -> None:
    """The four aggregation modes on a hand-sized batch (see the parameter comments)."""
    x = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    tm, sm = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), t([1.0, 1.0])
    out = aggregate(x, tm, sm, mode, 2.0, 4.0, constant=10.0)  # type: ignore[arg-type]
    assert out.item() == pytest.approx(expected)


def test_masked_mean_dtype() -> None:
    """Bool masks are accepted."""
    out = masked_mean(t([2.0, 4.0]), torch.tensor([True, False]))
    assert out.dtype == DT and out.item() == pytest.approx(2.0)
