"""The RMSNorm whose backward keeps only its input (``models/layers/rms_norm.py``) against
``torch.nn.functional.rms_norm`` (the norm of megatron's local spec) and fp64."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_mcore_rl.models.layers import row_blocks
from lightning_mcore_rl.models.layers.rms_norm import rms_norm
from lightning_mcore_rl.testing import run_on_ranks


def _run(fn: Any, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    """Output, ``dx``, ``dw`` and the bytes of the storages autograd keeps for the backward."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, w)
    (y * g).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "kept": sum(storages.values())}


def _torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs_forward_keeping_only_its_input(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[6, 5, 96]``: the output bitwise torch's; against fp64 the largest ``dx`` and ``dw``
    errors at most 1.1x torch's (fp32: the same formulas within rounding; bf16: both round
    the fp32 result once); in blocks of 3 rows ``dx`` bitwise, ``dw`` (summed block by block)
    within fp32 rounding; kept for
    the backward: the input and a ``[6, 5, 1]`` fp32 RMS (and the weight), where torch keeps the
    fp32 upcast input and the fp32 normalised input."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5, 96, generator=generator) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    g = torch.randn(6, 5, 96, generator=generator).to(dtype)
    ours, reference = _run(_ours, x, w, g), _run(_torch, x, w, g)
    exact = _run(_torch, x.double(), w.double(), g.double())
    assert torch.equal(ours["y"], reference["y"])
    for key in ("dx", "dw"):
        error = (ours[key].double() - exact[key]).abs().max()
        bound = (reference[key].double() - exact[key]).abs().max()
        assert error <= 1.1 * bound, (key, float(error), float(bound))
    size = x.element_size()
    assert ours["kept"] == x.numel() * size + 30 * 4 + w.numel() * size
    assert reference["kept"] >= 2 * x.numel() * 4
    monkeypatch.setattr(row_blocks, "CPU_BLOCK", 300)  # 300 // 96: blocks of 3 of the 30 rows
    blocked = _run(_ours, x, w, g)
    assert torch.equal(blocked["dx"], ours["dx"])  # row by row: the same arithmetic
    torch.testing.assert_close(blocked["dw"], ours["dw"], rtol=1e-6, atol=1e-6)  # summed in parts


def _norms(rank: int) -> dict[str, Any]:
    """The local spec's norms of an RMSNorm and a LayerNorm config, and the RMSNorm's weight
    tag under sequence parallelism."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
    from lightning_mcore_rl.models.layers.rms_norm import LocalNorm, RMSNorm
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt_config

    init_megatron_state()
    spec = get_packed_local_layer_spec(qk_layernorm=True)
    attention = spec.submodules.self_attention.submodules
    rms = tiny_gpt_config(normalization="RMSNorm")
    layer = tiny_gpt_config()  # LayerNorm
    norm = LocalNorm(rms, 64, eps=1e-6)
    sp = copy.copy(rms)  # SP needs TP > 1 in TransformerConfig's own checks; the norm reads it
    sp.sequence_parallel = True
    return {
        "spec": [
            spec.submodules.input_layernorm,
            spec.submodules.pre_mlp_layernorm,
            attention.q_layernorm,
            attention.k_layernorm,
        ]
        == [LocalNorm] * 4,  # fmt: skip
        "rms": type(norm) is RMSNorm and norm.eps == 1e-6 and norm.weight.shape == (64,),
        "keys": list(norm.state_dict()),
        "layernorm": isinstance(LocalNorm(layer, 64), torch.nn.LayerNorm),
        "wrapped": WrappedTorchNorm is not LocalNorm,
        "sp_tag": (
            getattr(norm.weight, "sequence_parallel", None),
            LocalNorm(sp, 64).weight.sequence_parallel,
        ),  # fmt: skip
    }


def test_the_local_spec_normalises_with_it() -> None:
    out = run_on_ranks(_norms, 1, timeout=120)[0]
    assert out["spec"] and out["rms"] and out["layernorm"] and out["wrapped"]
    assert out["keys"] == ["weight"]  # torch.nn.RMSNorm's checkpoint key
    assert out["sp_tag"] == (False, True)
