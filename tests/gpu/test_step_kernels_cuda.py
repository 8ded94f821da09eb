"""On a real GPU: the update preview and the SwiGLU function on CUDA tensors (their device
paths: 16M-element blocks, CUDA Adam/AdamW) against the update torch runs and autograd."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_the_preview_predicts_torchs_cuda_update(cls: type) -> None:
    from lightning_mcore_rl.reliability.update_check import UpdateSnapshot, update_measures
    from lightning_mcore_rl.reliability.update_preview import preview_measures

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 70, device="cuda")) for _ in range(2)]
    member = SimpleNamespace(optimizer=cls(params, lr=0.05, weight_decay=0.1))
    for step in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        predicted = preview_measures(member, "cuda", None)
        snapshot = UpdateSnapshot.take(member, params)
        member.optimizer.step()
        count, delta, norm = update_measures(snapshot, "cuda", None)
        assert predicted[0] == count == 0.0
        assert predicted[1] == pytest.approx(delta, rel=1e-5), step
        assert predicted[2] == pytest.approx(norm, rel=1e-6), step


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_on_cuda_matches_autograd(dtype: torch.dtype) -> None:
    from lightning_mcore_rl.models.layers.gated_mlp import swiglu

    torch.manual_seed(0)
    x = (torch.randn(4096, 2 * 1408, device="cuda") * 3).to(dtype)
    weight = torch.randn(4096, 1408, device="cuda").to(dtype)

    def grad(fn, inputs):  # type: ignore[no-untyped-def]
        inputs = inputs.detach().requires_grad_()
        (fn(inputs) * weight).sum().backward()
        return inputs.grad

    def unfused(t):  # type: ignore[no-untyped-def]
        gate, up = torch.chunk(t, 2, dim=-1)
        return F.silu(gate) * up

    assert torch.equal(swiglu(x), unfused(x))
    exact = grad(unfused, x.double())
    ours = (grad(swiglu, x).double() - exact).abs().max()
    autograd = (grad(unfused, x).double() - exact).abs().max()
    # fp32: both within rounding; bf16: ours rounds once, autograd op by op
    assert ours <= autograd * 1.01 + 1e-6, (float(ours), float(autograd))
