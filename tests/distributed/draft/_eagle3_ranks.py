"""Rank workers of the EAGLE-3 draft tests: the draft trained in the policy's step (as in
``_draft_ranks``), its export to an EAGLE-3 Hugging Face directory, and a plain-torch EAGLE-3
forward (vLLM's ``llama_eagle3`` math over the exported ``config.json`` + ``model.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _draft_ranks import AUX, LAYERS, V, draft_step
from safetensors.torch import load_file

from lightning_mcore_rl.models.eagle3 import eagle3_draft, save_eagle3
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.testing import destroy_megatron_state, init_megatron_state

S, B = 12, 2


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Captured-like hidden states ``[S, B, 2H]`` (two aux layers, H = 64) and next ids."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(S, B, 2 * 64, generator=g), torch.randint(0, V, (B, S), generator=g)


def _draft(groups: Any = None) -> Any:
    config = tiny_gpt_config(groups, num_layers=LAYERS)
    return eagle3_draft(config, vocab_size=V, aux_layers=AUX, groups=groups, seed=1)


def export_and_forward(root: str, name: str) -> dict[str, Any]:
    """Export this layout's draft to ``root/name`` and run its forward on :func:`inputs`
    (megatron state initialised by the caller)."""
    groups = megatron_groups()
    draft = _draft(groups)
    hidden, next_ids = inputs()
    with torch.no_grad():
        logits = draft(hidden, next_ids)
    save_eagle3(draft, f"{root}/{name}", groups=groups, max_position_embeddings=64)
    return {"logits": logits}


def reference_logits(directory: str | Path) -> torch.Tensor:
    """vLLM's EAGLE-3 forward in plain torch from the exported files: ``h = fc(hidden)``;
    ``x = [RMSNorm_in(E[y]) ; RMSNorm_h(h)]``; causal attention with Llama rope (q/k/v/o);
    ``r = attn + h``; SwiGLU MLP on ``RMSNorm_post(r)``; ``lm_head(RMSNorm(mlp + r))``."""
    config = json.loads((Path(directory) / "config.json").read_text())
    w = load_file(str(Path(directory) / "model.safetensors"))
    eps, heads, dim = config["rms_norm_eps"], config["num_attention_heads"], config["head_dim"]
    hidden, next_ids = inputs()

    def rms(x: torch.Tensor, key: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[key]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [B, n, S, d]
        inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.arange(S).float()[:, None] * inv
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    h = hidden.transpose(0, 1) @ w["fc.weight"].T  # [B, S, H]
    e = w["embed_tokens.weight"][next_ids]
    x = torch.cat([rms(e, "midlayer.input_layernorm.weight"),
                   rms(h, "midlayer.hidden_norm.weight")], -1)  # fmt: skip

    def proj(name: str) -> torch.Tensor:
        out = x @ w[f"midlayer.self_attn.{name}_proj.weight"].T
        return out.view(B, S, heads, dim).transpose(1, 2)

    q, k, v = rope(proj("q")), rope(proj("k")), proj("v")
    scores = q @ k.transpose(-1, -2) / dim**0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, heads * dim)
    r = attn @ w["midlayer.self_attn.o_proj.weight"].T + h
    n = rms(r, "midlayer.post_attention_layernorm.weight")
    mlp = (F.silu(n @ w["midlayer.mlp.gate_proj.weight"].T) * (n @ w["midlayer.mlp.up_proj.weight"].T)
           ) @ w["midlayer.mlp.down_proj.weight"].T  # fmt: skip
    return rms(mlp + r, "norm.weight") @ w["lm_head.weight"].T


def single_rank_run(rank: int, root: str) -> dict[str, Any]:
    """TP=1: export + forward; the draft trained in the step (padded, two microbatches, packed)."""
    init_megatron_state()
    return {
        "export": export_and_forward(root, "tp1"),
        "on": draft_step(draft=True, eagle3=True),
        "on_M2": draft_step(draft=True, mbs=2, eagle3=True),
        "packed_M2": draft_step(draft=True, packed=True, mbs=2, eagle3=True),
        "off": draft_step(draft=False),
    }


def two_rank_run(rank: int, root: str) -> dict[str, Any]:
    """TP=2: export + forward, the step padded and packed; PP=2: the step."""
    init_megatron_state(tensor_model_parallel_size=2)
    out = {
        "export": export_and_forward(root, "tp2"),
        "tp2": draft_step(draft=True, eagle3=True),
        "tp2_packed": draft_step(draft=True, packed=True, mbs=2, eagle3=True),
    }
    destroy_megatron_state()
    init_megatron_state(pipeline_model_parallel_size=2)
    out["pp2"] = draft_step(draft=True, mbs=2, eagle3=True)
    return out
