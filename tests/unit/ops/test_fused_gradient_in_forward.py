"""The fused LM head's gradient in the forward (``logprob_gradient``): the head's gradients
computed in the forward for a predicted logprob gradient, against plain autograd through the
full logits.

fp64 (rounding-free comparison): a token-local clipped policy-gradient loss gives the autograd
gradients to 1e-12 at any chunking and temperature, also when the schedule scales the loss (the
backward rescales by the received gradient's ratio to the prediction); a loss that is not
token-local warns and recomputes, still exact. ``prediction_scale`` finds the scale and refuses
what is not one. bf16: as close to the fp64 gradients as the recomputing backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from helpers.unit import FakeGroup

from lightning_mcore_rl.ops import (
    GradientPredictionWarning,
    from_hidden_to_logprobs,
    fused_linear_logprobs,
)
from lightning_mcore_rl.ops.fused_linear import _FP32_ACCUMULATION_MAX_TOKENS, prediction_scale

G = FakeGroup()
T, H, V = 37, 16, 50
Loss = Callable[[torch.Tensor], torch.Tensor]


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, dtype=torch.float64, generator=gen).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen).requires_grad_()
    return hidden, weight, torch.randint(0, V, (T,), generator=gen)


def _clipped_pg() -> Loss:
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(T, dtype=torch.float64, generator=gen) - 3.0
    adv = torch.randn(T, dtype=torch.float64, generator=gen)
    mask = (torch.rand(T, generator=gen) > 0.2).double()

    def loss(lp: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(lp - old)
        return (torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask).sum() / mask.sum()

    return loss


def _gradient_of(loss: Loss) -> Callable[[torch.Tensor], torch.Tensor]:
    def gradient(lp: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = lp.detach().requires_grad_()
            (grad,) = torch.autograd.grad(loss(leaf), leaf)
        return grad

    return gradient


def _reference(
    loss: Loss, temperature: float, scale: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    hidden, weight, target = _operands()
    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    lp = logp.gather(-1, target[:, None]).squeeze(-1)
    return lp.detach(), torch.autograd.grad(loss(lp) * scale, (hidden, weight))


@pytest.mark.parametrize("chunk", [1, 5, T])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_gradients_equal_autograd(chunk: int, temperature: float) -> None:
    loss = _clipped_pg()
    ref_lp, ref_grads = _reference(loss, temperature, scale=3.0)
    hidden, weight, target = _operands()
    out = fused_linear_logprobs(
        hidden, weight, target, 0, V, G, chunk, temperature,
        logprob_gradient=_gradient_of(loss),
    )  # fmt: skip
    grads = torch.autograd.grad(loss(out.logprobs) * 3.0, (hidden, weight))
    assert torch.allclose(out.logprobs, ref_lp, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_a_loss_that_is_not_token_local_warns_and_recomputes_exactly() -> None:
    def loss(lp: torch.Tensor) -> torch.Tensor:  # d/dlp_t = 2 sum(lp): every token's logprob
        return lp.sum() ** 2

    _, ref_grads = _reference(loss, 1.0, scale=1.0)
    hidden, weight, target = _operands()
    out = fused_linear_logprobs(
        hidden, weight, target, 0, V, G, 5, logprob_gradient=_gradient_of(loss)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = torch.autograd.grad(loss(out.logprobs), (hidden, weight))
    assert [w.category for w in caught] == [GradientPredictionWarning]
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-10, atol=0)


def test_dense_rows_map_the_gradient_onto_the_kernel_tokens() -> None:
    """``from_hidden_to_logprobs``: ``[B, S-1]`` loss gradients on a ``[B, S, H]`` batch."""
    gen = torch.Generator().manual_seed(2)
    batch, width = 3, 9
    hidden = torch.randn(batch, width, H, dtype=torch.float64, generator=gen).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen).requires_grad_()
    ids = torch.randint(0, V, (batch, width), generator=gen)
    coef = torch.randn(batch, width - 1, dtype=torch.float64, generator=gen)

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return (coef * torch.exp(lp)).sum()

    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)[:, :-1]
    ref_lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref_grads = torch.autograd.grad(loss(ref_lp), (hidden, weight))
    lp = from_hidden_to_logprobs(
        hidden, weight, ids, 0, V, G, None, 4, logprob_gradient=_gradient_of(loss)
    )
    grads = torch.autograd.grad(loss(lp), (hidden, weight))
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_prediction_scale() -> None:
    predicted = torch.tensor([0.5, -2.0, 0.0, 1e-3])
    assert prediction_scale(predicted * 4.0, predicted) == pytest.approx(4.0, rel=1e-12)
    assert prediction_scale(torch.zeros(4), torch.zeros(4)) == 0.0
    assert prediction_scale(torch.tensor([0.0, 0.0, 1.0, 0.0]), predicted) is None
    off = predicted.clone()
    off[3] += 1e-3  # 5e-4 of max |received|: beyond rounding
    assert prediction_scale(off, predicted) is None


def test_gradient_in_forward_refuses_entropy_and_context_parallelism() -> None:
    hidden, weight, target = _operands()
    gradient = _gradient_of(_clipped_pg())
    with pytest.raises(ValueError, match="return_entropy"):
        fused_linear_logprobs(
            hidden, weight, target, 0, V, G, 5, return_entropy=True, logprob_gradient=gradient
        )
    with pytest.raises(ValueError, match="CP = 1"):
        from_hidden_to_logprobs(
            hidden[None], weight, target[None], 0, V, G, FakeGroup(0, 2), 5,
            logprob_gradient=gradient,
        )  # fmt: skip


@pytest.mark.parametrize("chunk", [64, 288])
def test_bf16_forward_gradients_are_as_close_to_fp64_as_the_recomputing_backward(
    chunk: int,
) -> None:
    """bf16 operands: both backwards round (bf16 GEMMs). Measured, relative to the fp64 gradient
    norm, hidden / weight, gradient in the forward vs recomputing backward: 64-token chunks
    4.3e-3 / 3.4e-3 vs 4.5e-3 / 4.1e-3 (the weight's accumulated by an fp32 ``addmm_`` from the
    fp32 ``dz``); 288-token chunks 4.3e-3 / 4.2e-3 vs 4.7e-3 / 4.1e-3 (a bf16 product of ``dz``
    rounded to bf16, summed in fp32). Bound: 1e-2, and within 1.5x of the recomputing
    backward's own error; with the fp32 accumulation the weight's at most the recomputing
    backward's (which multiplies ``dz`` rounded to bf16)."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab = 300, 64, 1000
    hidden = torch.randn(tokens, hidden_size, dtype=torch.float64, generator=gen)
    weight = 0.1 * torch.randn(vocab, hidden_size, dtype=torch.float64, generator=gen)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    coef = torch.randn(tokens, dtype=torch.float64, generator=gen)

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return (coef * torch.exp(lp)).sum()

    def grads(dtype: torch.dtype, in_forward: bool) -> tuple[torch.Tensor, ...]:
        h = hidden.to(dtype).requires_grad_()
        w = weight.to(dtype).requires_grad_()
        gradient = _gradient_of(loss) if in_forward else None
        out = fused_linear_logprobs(h, w, target, 0, vocab, G, chunk, logprob_gradient=gradient)
        return tuple(g.double() for g in torch.autograd.grad(loss(out.logprobs), (h, w)))

    ref = grads(torch.float64, in_forward=False)
    forward, recompute = grads(torch.bfloat16, True), grads(torch.bfloat16, False)
    errors = []
    for got, base, want in zip(forward, recompute, ref, strict=True):
        error, base_error = (float((x - want).norm() / want.norm()) for x in (got, base))
        assert error <= 1e-2
        assert error <= 1.5 * base_error
        errors.append((error, base_error))
    weight_error, weight_base_error = errors[1]
    if chunk < _FP32_ACCUMULATION_MAX_TOKENS:
        assert weight_error <= weight_base_error
