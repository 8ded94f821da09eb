"""The SwiGLU MLP whose backward keeps only ``linear_fc1``'s output (``models/layers/gated_mlp.py``)
against torch's autograd of the unfused SwiGLU and megatron's own ``MLP``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mcore_rl.models.layers import row_blocks
from lightning_mcore_rl.models.layers.gated_mlp import swiglu
from lightning_mcore_rl.testing import run_on_ranks


def _unfused(x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _saved_bytes(fn: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``fn(x)`` and the bytes of the distinct storages autograd keeps for its backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(storages.values())


def _grad(fn: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (fn(x) * weight).sum().backward()
    assert x.grad is not None
    return x.grad


def test_swiglu_is_bitwise_forward_keeps_only_its_input_and_matches_autograd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 ``[6, 5, 2F=14]``: the forward bitwise the unfused one; the backward within fp32
    rounding of autograd's (the same formulas), and bitwise the same in blocks of 2 rows as in
    one; only ``x`` is kept (autograd keeps ``x`` and ``silu(gate)``)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 14, generator=generator) * 3
    weight = torch.randn(6, 5, 7, generator=generator)
    ours, kept = _saved_bytes(swiglu, x.clone().requires_grad_())
    reference, reference_kept = _saved_bytes(_unfused, x.clone().requires_grad_())
    assert torch.equal(ours, reference)
    assert kept == x.numel() * 4 and reference_kept == kept + x.numel() // 2 * 4
    whole = _grad(swiglu, x, weight)
    torch.testing.assert_close(whole, _grad(_unfused, x, weight), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(row_blocks, "CPU_BLOCK", 16)  # 16 // F=7: blocks of 2 of the 30 rows
    assert torch.equal(_grad(swiglu, x, weight), whole)
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.zeros(2, 3))


def test_swiglu_bf16_gradient_is_no_less_accurate_than_autograds() -> None:
    """bf16 input: the backward runs in fp32 and rounds once, autograd rounds op by op; against
    fp64 the largest error of ours is at most autograd's (measured: about half of it)."""
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 512, generator=generator) * 3).bfloat16()
    weight = torch.randn(64, 256, generator=generator).bfloat16()
    exact = _grad(_unfused, x.double(), weight.double())
    ours = (_grad(swiglu, x, weight).double() - exact).abs().max()
    autograd = (_grad(_unfused, x, weight).double() - exact).abs().max()
    assert ours <= autograd, (float(ours), float(autograd))
    assert torch.equal(swiglu(x), _unfused(x))


def _mlp_pair(rank: int) -> dict[str, Any]:
    """megatron's ``MLP`` and :class:`GatedMLP` from the same seed on one rank, fp32 SwiGLU:
    outputs, gradients, bytes kept for the backward, checkpoint keys; the plain cases."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    from lightning_mcore_rl.models.layers.gated_mlp import GatedMLP, SwiGLU
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt_config

    init_megatron_state()
    mlp_entry = get_gpt_layer_local_spec().submodules.mlp
    # a ModuleSpec before megatron-core 0.19, partial(MLP.as_mlp_submodule, submodules=...) from it
    submodules = getattr(mlp_entry, "submodules", None) or mlp_entry.keywords["submodules"]
    config = tiny_gpt_config(gated_linear_unit=True, activation_func=F.silu, ffn_hidden_size=48)
    out: dict[str, Any] = {}
    x = torch.randn(12, 3, config.hidden_size, generator=torch.Generator().manual_seed(2))
    for name, cls in (("megatron", MLP), ("ours", GatedMLP)):
        torch.manual_seed(5)
        mlp = cls(config, submodules)
        inputs = x.clone().requires_grad_()
        y, kept = _saved_bytes(lambda t, m=mlp: m(t)[0], inputs)
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        out[name] = {
            "y": y.detach(), "kept": kept, "dx": inputs.grad,
            "grads": {k: p.grad for k, p in mlp.named_parameters()},
            "keys": sorted(mlp.state_dict().keys()),
            "activation": type(mlp.activation_func).__name__,
        }  # fmt: skip
    out["model_config_flag"] = config.use_te_activation_func
    plain = {
        "gelu": tiny_gpt_config(),  # not gated
        "clamp": tiny_gpt_config(
            gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=5.0
        ),  # fmt: skip
    }
    out["plain"] = {
        name: GatedMLP(cfg, submodules).activation_func is cfg.activation_func
        for name, cfg in plain.items()
    }
    out["swiglu_module"] = isinstance(GatedMLP(config, submodules).activation_func, SwiGLU)
    return out


def test_gated_mlp_is_megatrons_mlp_keeping_less_for_the_backward() -> None:
    """fp32, 36 tokens, F=48: the same output bitwise, gradients within fp32 rounding, the same
    parameters and checkpoint keys, and exactly ``2 x tokens x F`` fp32 values fewer kept for
    the backward (``silu(gate)`` and the ``up + glu_linear_offset`` copy); the model's config is
    not changed; a non-SwiGLU MLP stays megatron's."""
    out = run_on_ranks(_mlp_pair, 1, timeout=120)[0]
    ours, megatron = out["ours"], out["megatron"]
    assert torch.equal(ours["y"], megatron["y"])
    torch.testing.assert_close(ours["dx"], megatron["dx"], rtol=1e-6, atol=1e-6)
    assert ours["grads"].keys() == megatron["grads"].keys()
    for key, grad in ours["grads"].items():
        torch.testing.assert_close(grad, megatron["grads"][key], rtol=1e-6, atol=1e-6)
    assert ours["keys"] == megatron["keys"]
    assert megatron["kept"] - ours["kept"] == 2 * 36 * 48 * 4
    assert out["swiglu_module"] and out["model_config_flag"] is False
    assert out["plain"] == {"gelu": True, "clamp": True}
