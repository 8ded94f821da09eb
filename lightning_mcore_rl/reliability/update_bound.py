"""A cheap certificate that torch's `Adam`/`AdamW` update passes the update check (trainer-free):
`certify_update` reads the parameters and Adam moments once (no arithmetic of the update) and
proves, with one all-reduce, that `update_preview.preview_measures` would find no NaN/inf and an
update within `max_update_ratio`; when it cannot, the exact preview runs."""

# The guarantee is the preview's, unchanged: the certificate passes only when the preview (and the
# update torch then runs) would pass; every other step is previewed exactly as before. Nothing is
# assumed about how the state was produced: a resumed, foreign or corrupted state is read like any
# other, and the certificate rests only on what it reads at this step and on the gradient bound.
#
# The bound (per parameter; m, v: the moments before the step, g: its gradient after clipping,
# with coupled weight decay g + wd*p; b1, b2: betas; t: the step being taken):
#   0. From zero, Adam keeps |m| <= R sqrt(v) elementwise for every gradient sequence (step 2
#      from r = 0, repeated), R^2 = (1-b1)^2 / (1-b2) / (1 - b1^2/b2) when b1^2 < b2.
#   1. Read: m_i^2 / R^2 - v_i <= tau for every i (so |m_i| <= R (sqrt(v_i) + sqrt(tau))),
#      V = max_i v_i, min_i v_i >= 0, ||p||; G >= max_i |g_i| (megatron's global gradient norm
#      before clipping, which bounds every entry of every clipped gradient; else read).
#   2. Adam's moments: m' = b1 m + (1-b1) g, v' = b2 v + (1-b2) g^2. Cauchy-Schwarz,
#      (a x + b y)^2 <= (a^2/alpha + b^2/beta)(alpha x^2 + beta y^2), with a = b1 r, x = sqrt(v),
#      b = 1-b1, y = |g|, alpha = b2, beta = 1-b2:
#        |m'| <= b1 r sqrt(v) + (1-b1)|g| + b1 r sqrt(tau) <= Q sqrt(v') + b1 r sqrt(tau),
#        Q^2 = b1^2 r^2 / b2 + (1-b1)^2 / (1-b2)   (= R^2 at r = R: the fixed point of step 0),
#      whatever the gradient (its size cancels: that is why Adam's step is bounded).
#   3. The step: u = (m'/bc1) / (sqrt(v')/sqrt(bc2) + eps), bc_k = 1 - b_k^t, so
#        |u_i| <= (Q sqrt(bc2) + b1 r sqrt(tau) / eps) / bc1 =: U for every element, and
#        ||update|| <= lr wd ||p|| (decoupled decay) + lr U sqrt(numel).
#   4. Finite: with finite p, m, v >= 0 and g, |m'| <= b1 r sqrt(V + tau) + (1-b1) G and
#      v' <= b2 V + (1-b2) G^2; when numel times each of these (and of the update's square) is far
#      below the float32 maximum, no element, sum or norm the preview takes overflows.
# Rounding: every value above is what float32 arithmetic computes, not the exact one. Each of the
# few operations per element errs by a few units in the last place relative to its exact value
# (lerp's subtraction relative to |m| + |g|, at most 1/min(b1, 1-b1) times that relative to
# b1|m| + (1-b1)|g|), and by an absolute `_ABSOLUTE` near zero (subnormals, flush-to-zero): the
# bounds carry a factor (1 + `_RELATIVE`) per step of the argument and `_ABSOLUTE` terms, far
# more than float32 or float64 rounding needs (so step 1's R is R (1 + 1e-3) read, to pass the
# states Adam's rounded arithmetic produces); a low-precision state (bf16) is not certified.
# The certificate fails (the preview runs) for anything else: SGD, amsgrad, eps = 0,
# b1^2 >= b2, a moment pair above R, a non-finite or negative entry, a bound above the ratio
# (lr=1e8), a bound that could overflow.

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.reliability.update_check import optimizer_members, reduce_measures

_RELATIVE = 1e-4  # per-step rounding allowance (float32's unit roundoff is 6e-8)
_ABSOLUTE = 1e-36  # absolute rounding near zero (float32 flushes below 1.2e-38)
_TAU = 1e-30  # step 1's slack at v = 0 (m underflowing beside it)
_READ_MARGIN = 1e-3  # step 1 reads against R (1 + this): Adam's rounded states pass
_ULP = 1e-6  # new - old in float32 errs by an ulp of |p_i| (1.2e-7 |p_i|), 8 x that
_LIMIT = 1e30  # numel x a bound on an element (or its square) stays below this (float32: 3.4e38)
_CERTIFIED_DTYPES = (torch.float32, torch.float64)

_CPU_BLOCK = 1 << 18
"""Elements per block of the moments' pass on CPU: its scratch and the blocks of m and v (1 MiB
each in float32) stay in the cache."""

_DEVICE_BLOCK = 1 << 24


def certifiable(optimizer: Any) -> bool:
    """Whether every member's inner optimizer is exactly torch's `Adam` or `AdamW` over float32
    or float64 parameters, without amsgrad, with eps > 0 and 0 <= beta1 < 1, 0 < beta2 < 1,
    beta1^2 < beta2 (Adam's bounded ratio of the moments)."""
    # the same answer on every rank: it depends on the optimizer config only
    for member in optimizer_members(optimizer):
        inner: Any = getattr(member, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        for options in inner.param_groups:
            beta1, beta2 = (float(b) for b in options["betas"])
            if options.get("amsgrad", False) or not float(options["eps"]) > 0:
                return False
            if not (0.0 <= beta1 < 1.0 and 0.0 < beta2 < 1.0 and beta1**2 < beta2):
                return False
            if any(p.dtype not in _CERTIFIED_DTYPES for p in options["params"]):
                return False
    return True


def certify_update(
    optimizer: Any,
    device: torch.device | str,
    group: Any,
    max_update_ratio: float | None,
    grad_bound: float | None = None,
    block: int | None = None,
) -> bool:
    """Before the update: True when the update is proven to leave no NaN/inf weight or state
    entry on any rank and to stay within `max_update_ratio` x the parameters' norm (ONE
    all-reduce over `group`, the same answer on every rank); False: not proven (`certifiable`
    False, or the bound too weak or not finite), preview it. `grad_bound`: a bound on every
    gradient entry on every rank (megatron's global gradient norm), else each is read."""
    if not certifiable(optimizer):
        return False
    count, bound, norm = bound_measures(optimizer, device, group, grad_bound, block)
    if count > 0 or not (math.isfinite(bound) and math.isfinite(norm)):
        return False
    if max_update_ratio is None:
        return True
    # the preview fails when ||update|| > ratio x ||parameters|| with ||parameters|| > 0; its
    # norm is computed in another order: a margin of 1e-4 covers that
    return norm > 0.0 and bound <= max_update_ratio * norm * (1.0 - _RELATIVE)


def bound_measures(
    optimizer: Any,
    device: torch.device | str,
    group: Any,
    grad_bound: float | None = None,
    block: int | None = None,
) -> tuple[float, float, float]:
    """Before the update: `(parameters without a bound, a bound on ||update||, ||parameters||)`
    over every rank (ONE all-reduce SUM of three float64 numbers over `group`), for a
    `certifiable` optimizer; a parameter has no bound where its moments are not Adam's or it
    could overflow (the comment at the top)."""
    if block is None:
        block = _CPU_BLOCK if torch.device(device).type == "cpu" else _DEVICE_BLOCK
    if grad_bound is not None and not math.isfinite(grad_bound):
        grad_bound = math.inf  # no bound: every parameter uncertain
    # (options, state, parameter, AdamW): per parameter, what its bound needs
    entries: list[tuple[dict[str, Any], Any, Tensor, bool]] = []
    measured: list[Tensor] = []  # per parameter: [||p||, max|g|, min v, max v, excess]
    with torch.no_grad():
        for member in optimizer_members(optimizer):
            inner = member.optimizer
            adamw = isinstance(inner, torch.optim.AdamW)
            for options in inner.param_groups:
                ratio_sq = _moment_ratio(options) ** 2 * (1.0 + _READ_MARGIN)
                for p in options["params"]:
                    state = inner.state.get(p, {})
                    entries.append((options, state, p, adamw))
                    measured.append(_measure(p, state, ratio_sq, grad_bound is None, block))
        rows = torch.stack(measured).double().cpu().tolist() if measured else []
    uncertain = bound_sq = norm_sq = 0.0
    for (options, state, p, adamw), row in zip(entries, rows, strict=True):
        norm_sq += row[0] ** 2
        if p.grad is None:
            continue  # not updated by torch: only its norm counts
        if grad_bound is not None:
            # megatron's norm, rounded in float32: within 1e-4 of the largest |g_i| at worst
            row[1] = grad_bound * (1.0 + _RELATIVE)
        bound = _update_bound(options, state, adamw, p.numel(), row)
        if bound is None:
            uncertain += 1.0
        else:
            bound_sq += bound**2
    numbers = torch.tensor([uncertain, bound_sq, norm_sq], dtype=torch.float64, device=device)
    return reduce_measures(numbers, group)


def _moment_ratio(options: dict[str, Any]) -> float:
    """R of step 0: Adam's bound on |m| / sqrt(v) for these betas (b1^2 < b2)."""
    beta1, beta2 = (float(b) for b in options["betas"])
    return math.sqrt((1.0 - beta1) ** 2 / (1.0 - beta2) / (1.0 - beta1**2 / beta2))


def _measure(
    p: Tensor, state: dict[str, Any], ratio_sq: float, read_grad: bool, block: int
) -> Tensor:
    """`[||p||, max|g| (0 unless read_grad), min v, max v, max(m^2 / ratio_sq - v)]` (float32) of
    one parameter; zeros for the moments it lacks; NaN/inf propagate."""
    flat = p.detach().reshape(-1)
    zero = flat.new_zeros((), dtype=torch.float32)
    norm = torch.linalg.vector_norm(flat, dtype=torch.float32)
    if p.grad is None or flat.numel() == 0:
        return torch.stack([norm, zero, zero, zero, zero])
    gmax = zero
    if read_grad:
        low, high = torch.aminmax(p.grad.detach().reshape(-1))
        gmax = torch.maximum(-low, high).float()
    exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
    if exp_avg is None or exp_avg_sq is None:
        # no state yet: torch starts both moments at zero
        return torch.stack([norm, gmax, zero, zero, zero])
    m, v = exp_avg.detach().reshape(-1), exp_avg_sq.detach().reshape(-1)
    # one pass over m and v in cache-sized blocks: the extremes of v and step 1's excess
    scratch = torch.empty(min(block, m.numel()), dtype=m.dtype, device=m.device)
    lows, highs, excesses = [], [], []
    for start in range(0, m.numel(), block):
        end = min(start + block, m.numel())
        low, high = torch.aminmax(v[start:end])
        # v - m^2 / R^2 (NaN/inf in m propagate, an inf in v shows in `high`)
        slack = torch.addcmul(
            v[start:end], m[start:end], m[start:end], value=-1.0 / ratio_sq,
            out=scratch[: end - start],
        )  # fmt: skip
        lows.append(low)
        highs.append(high)
        excesses.append(-slack.amin())
    extremes = [torch.stack(x).amin() if x is lows else torch.stack(x).amax()
                for x in (lows, highs, excesses)]  # fmt: skip
    return torch.stack([norm, gmax, *(x.float() for x in extremes)])


def _update_bound(
    options: dict[str, Any], state: dict[str, Any], adamw: bool, numel: int, row: list[float]
) -> float | None:
    """A bound on the norm of one parameter's update as float32 computes it (the comment at the
    top), or `None` when step 1 fails, the bound is not finite, or an element, sum or norm could
    overflow."""
    norm, gmax, vmin, vmax, excess = row
    if not all(math.isfinite(x) for x in row) or vmin < 0.0:
        return None
    eps_r, tiny = _RELATIVE, _ABSOLUTE
    lr, eps, decay = float(options["lr"]), float(options["eps"]), float(options["weight_decay"])
    beta1, beta2 = (float(b) for b in options["betas"])
    ratio_sq = _moment_ratio(options) ** 2 * (1.0 + _READ_MARGIN)
    # step 1 read in float32: m^2 / R^2 - v within a few ulps of m^2 / R^2 + v (and a flush of
    # 1.2e-38 absolute, far below tau), so excess <= tau gives m^2 <= R^2 (1 + 1e-4) (v + 2 tau)
    if excess > _TAU:
        return None  # moments Adam's own updates cannot produce (or a corrupt state)
    # no state yet: torch starts from m = v = 0, so r = 0
    r = math.sqrt(ratio_sq * (1.0 + eps_r)) if "exp_avg" in state else 0.0
    tau = 2.0 * _TAU
    decoupled = adamw or bool(options.get("decoupled_weight_decay", False))
    step = float(state["step"]) + 1.0 if "step" in state else 1.0
    # |p_i| <= ||p||; coupled decay feeds g + wd p to the moments
    g_bound = gmax if decoupled else gmax + abs(decay) * norm
    # step 2, each operation's rounding included: |m'| <= K (sqrt(v') + sqrt(tiny)) + extra
    q = math.sqrt(beta1**2 * r**2 / beta2 + (1.0 - beta1) ** 2 / (1.0 - beta2))
    k = q * (1.0 + eps_r) ** 2 / math.sqrt(1.0 - eps_r)
    extra = (1.0 + eps_r) * beta1 * r * math.sqrt(tau) + tiny
    # step 3
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    if not bc1 > 0.0 or not bc2 > 0.0:
        return None
    u = (1.0 + eps_r) ** 3 * (k * math.sqrt(bc2) + (k * math.sqrt(tiny) + extra) / eps) / bc1
    decay_step = lr * abs(decay) * norm if decoupled else 0.0
    # new - old computed in float32: off by an ulp of |p_i| at most
    bound = (1.0 + eps_r) * (decay_step + abs(lr) * u * math.sqrt(numel)) + _ULP * norm
    # step 4: nothing the preview sums or squares overflows
    m_new = (1.0 + eps_r) * (beta1 * r * math.sqrt(vmax + tau) + (1.0 - beta1) * g_bound) + tiny
    v_new = (1.0 + eps_r) * (beta2 * vmax + (1.0 - beta2) * g_bound**2) + tiny
    element = (1.0 + eps_r) * (lr * abs(decay) * norm + abs(lr) * u) + _ULP * norm
    worst = max(m_new, v_new, element**2, g_bound**2, (norm + element) ** 2)
    if not math.isfinite(bound) or not numel * worst < _LIMIT:
        return None
    return bound


__all__ = ["bound_measures", "certifiable", "certify_update"]
