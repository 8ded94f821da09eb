"""On a CUDA GPU with Transformer Engine, ``build_chunk``'s default (TE) layer spec and the local
spec give the same Qwen3 logits (bf16; the TE spec fuses the layer norms into the linears)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _hf_ranks import build_hf_model, hf_configs, input_ids

from lightning_mcore_rl.testing import run_on_ranks

# bf16 keeps 8 mantissa bits: logits of magnitude <= 2 round to ~8e-3; two different kernels'
# accumulation orders stay within a few of those steps.
BF16_ATOL = 3e-2


def _te_and_local_logits(rank: int, directory: str) -> dict[str, torch.Tensor]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    bridge = HFBridge.from_pretrained(directory)
    config = bridge.transformer_config(bf16=True, params_dtype=torch.bfloat16)
    local_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    ids = input_ids().cuda()
    positions = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    out = {}
    for label, spec in (("te", None), ("local", local_spec)):
        chunk = bridge.build_chunk(config, transformer_layer_spec=spec).cuda().eval()
        names = [n for n in chunk.state_dict() if "layer_norm_weight" in n]
        out[f"{label}_fused_norms"] = len(names)
        with torch.no_grad():
            out[label] = chunk(ids, positions, None).float().cpu()
        # gloo collectives take CPU tensors
        exported = dict(bridge.export_hf_weights([chunk.cpu()], dtype=torch.float32))
        out[f"{label}_export_names"] = sorted(exported)
    return out


@pytest.mark.gpu
def test_transformer_engine_spec_matches_local_spec(tmp_path):
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs Transformer Engine")
    build_hf_model(hf_configs()["qwen3"], tmp_path / "qwen3", seed=2)
    (out,) = run_on_ranks(_te_and_local_logits, 1, str(tmp_path / "qwen3"), emulate_cuda=False)
    assert out["te_fused_norms"] == 4 and out["local_fused_norms"] == 0  # 2 layers x 2 norms
    assert out["te_export_names"] == out["local_export_names"]
    torch.testing.assert_close(out["te"], out["local"], atol=BF16_ATOL, rtol=0)
