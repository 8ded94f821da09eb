"""float64 ``gradcheck`` of every ops autograd function on one process (TP = CP = 1).

A size-1 group skips every collective, so a rank/size-only fake group suffices here; the
multi-rank parity tests live in ``tests/distributed/ops``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    distributed_log_softmax,
    distributed_logprob,
    distributed_logprob_with_sampling,
    distributed_logprobs_at_indices,
    fused_linear_logprobs,
    gather_logits_at_global_indices,
    get_distillation_topk_logprobs_from_logits,
    vocab_parallel_entropy,
    vocab_parallel_reverse_kl,
)


class SoloGroup:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


G = SoloGroup()
B, S, V = 2, 5, 7


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))


def test_gradcheck_log_softmax_entropy_and_gathers() -> None:
    target, ids = _ids(B, S), _ids(B, S, 3)
    logits = _leaf(B, S, V)
    assert torch.autograd.gradcheck(lambda z: distributed_log_softmax(z, G), (logits,))
    assert torch.autograd.gradcheck(
        lambda z: distributed_logprob(z, target, 0, V, G, chunk_size=2), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda z: distributed_logprobs_at_indices(z, ids, 0, V, G, chunk_size=3), (logits,)
    )
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_entropy(z, G, 2), (logits,))
    assert torch.autograd.gradcheck(
        lambda z: gather_logits_at_global_indices(z, ids, 0, V, G), (logits,)
    )
    teacher = torch.randn(B, S, 3, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda z: tuple(
            get_distillation_topk_logprobs_from_logits(z, teacher, ids, True, True, 0, V, G)[::2]
        ),
        (logits,),
    )


def test_unchunked_logprob_matches_autograd_and_runs_backward_once() -> None:
    target, logits = _ids(B, S), _leaf(B, S, V)
    weights = torch.randn(B, S, dtype=torch.float64)
    out = distributed_logprob(logits, target, 0, V, G)
    (grad,) = torch.autograd.grad((out * weights).sum(), logits, retain_graph=True)
    ref = F.log_softmax(logits, -1).gather(-1, target[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)
    with pytest.raises(RuntimeError, match=r"can run only once; pass a `chunk_size`"):
        torch.autograd.grad((out * weights).sum(), logits)


def test_gradcheck_sampling_kernel() -> None:
    logits, target = _leaf(B, S, V, seed=3), _ids(B, S)
    params = TrainingSamplingParams(top_k=4, top_p=0.8)
    # perturbations of 1e-6 do not change the kept set of these well-separated random logits

    def fn(z: torch.Tensor) -> torch.Tensor:
        out = distributed_logprob_with_sampling(z, target, 0, V, G, params, chunk_size=2)
        return torch.where(torch.isfinite(out), out, 0.0)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_gradcheck_fused_linear_and_reverse_kl() -> None:
    hidden, weight, target = _leaf(6, 3, seed=4), _leaf(V, 3, seed=5), _ids(6)

    def fused(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = fused_linear_logprobs(h, w, target, 0, V, G, 4, 0.7, return_entropy=True)
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fused, (hidden, weight))
    teacher = torch.randn(B, S, V, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda z: vocab_parallel_reverse_kl(z, teacher, G, 2).reverse_kl, (_leaf(B, S, V),)
    )


def test_fp32_inputs_are_not_modified_in_place() -> None:
    logits = torch.randn(B, S, V) * 5
    hidden, weight = torch.randn(6, 3), torch.randn(V, 3)
    teacher = torch.randn(B, S, V)
    before = [t.clone() for t in (logits, hidden, weight, teacher)]
    target, ids = _ids(B, S), _ids(B, S, 3)
    for chunk in (None, 2):
        leaf = logits.requires_grad_()
        outs = [
            distributed_logprob(leaf, target, 0, V, G, chunk_size=chunk),
            vocab_parallel_entropy(leaf, G, chunk),
            vocab_parallel_reverse_kl(leaf, teacher, G, chunk, True).reverse_kl,
            distributed_logprob_with_sampling(
                leaf, target, 0, V, G, TrainingSamplingParams(top_k=3)
            ),
            distributed_logprobs_at_indices(leaf, ids, 0, V, G, chunk),
            distributed_log_softmax(leaf, G).sum(-1),
        ]
        sum(torch.where(torch.isfinite(o), o, 0.0).sum() for o in outs).backward()
        fused_linear_logprobs(hidden, weight, _ids(6), 0, V, G, chunk, 0.5, True)
        logits.requires_grad_(False)
    for original, now in zip(before, (logits, hidden, weight, teacher), strict=True):
        assert torch.equal(original, now.detach())
