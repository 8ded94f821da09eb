"""The megatron-core GPT <-> Hugging Face weight map and its tensor-parallel layouts (`h` hidden,
`H` query heads, `G` key/value groups, `d` head dim, `F` MLP width, `V` vocab; MoE: `E` experts
of width `F_e`, split over the expert TP group instead of TP)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import torch

from lightning_mcore_rl.models.hf.config import Architecture, MoEArchitecture
from lightning_mcore_rl.models.hf.safetensors_io import SafetensorsReader

Layout = Literal["replicated", "dim0", "dim1", "qkv", "fc1"]
"""How a megatron parameter is built from its HF tensor(s) and split over TP:

* ``replicated``: the HF tensor, on every rank (norms).
* ``dim0`` / ``dim1``: the HF tensor split evenly on that dim (vocab rows; ``o_proj``/``down_proj``
  input columns).
* ``qkv``: ``q [H d, ...]``, ``k``, ``v [G d, ...]`` interleaved by query group into
  ``[G, (H/G + 2) d, ...]``; TP splits the groups.
* ``fc1``: ``gate``, ``up [F, h]`` each split on dim 0, each rank holding ``[gate_r; up_r]``.
"""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")

# layer-local megatron suffix -> (layout, HF suffixes under ``model.layers.{i}.``); the
# ``layer_norm_weight`` names are Transformer Engine's fused norm + linear layers.
_LAYER_MAP: dict[str, tuple[Layout, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("dim1", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("dim1", ("mlp.down_proj.weight",)),
}


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One megatron parameter's HF source tensor(s) and TP layout."""

    layout: Layout
    hf_names: tuple[str, ...]


def param_map(name: str, global_layer: int | None, tied: bool) -> ParamMap:
    """Map a megatron `GPTModel.state_dict()` name (chunk-local layer index; `global_layer` its
    0-based index in the whole model, `None` off the layers); raises `KeyError` for a name with no
    HF counterpart."""
    if name == "embedding.word_embeddings.weight":
        return ParamMap("dim0", ("model.embed_tokens.weight",))
    # tied: `output_layer.weight` is the last stage's copy of the embedding
    if name == "output_layer.weight":
        return ParamMap("dim0", ("model.embed_tokens.weight" if tied else "lm_head.weight",))
    if name == "decoder.final_layernorm.weight":
        return ParamMap("replicated", ("model.norm.weight",))
    match = _LAYER.match(name)
    if match is None or match.group(2) not in _LAYER_MAP or global_layer is None:
        raise KeyError(f"megatron parameter {name!r} has no Hugging Face counterpart")
    layout, suffixes = _LAYER_MAP[match.group(2)]
    return ParamMap(layout, tuple(f"model.layers.{global_layer}.{s}" for s in suffixes))


def moe_param_map(
    name: str, global_layer: int | None, moe: MoEArchitecture, first_expert: int
) -> ParamMap | None:
    """Map a router or routed-expert parameter (`None` for any other name); `first_expert` is the
    global index of this rank's local expert 0 (`ep_rank * E / EP`)."""
    match = _LAYER.match(name)
    if match is None or global_layer is None:
        return None
    suffix = match.group(2)
    # the router is replicated over TP and EP: every rank routes its own tokens over all E experts
    if suffix == "mlp.router.weight":
        return ParamMap("replicated", (moe.router_name(global_layer),))
    expert = _EXPERT.match(suffix)
    if expert is None:
        return None
    # local expert k of this rank is global expert first_expert + k
    gate, up, down = moe.expert_names(global_layer, first_expert + int(expert.group(1)))
    return ParamMap("fc1", (gate, up)) if expert.group(2) == "1" else ParamMap("dim1", (down,))


def _mlp_groups(arch: Architecture, layer: int) -> list[dict[str, tuple[int, ...]]]:
    """The HF tensors of layer `layer`'s MLP, grouped as in `_hf_groups`."""
    h, p = arch.hidden_size, f"model.layers.{layer}."
    if arch.dense_layers[layer]:
        f = arch.ffn_hidden_size
        return [
            {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)},
            {p + "mlp.down_proj.weight": (h, f)},
        ]
    moe = arch.moe
    assert moe is not None  # dense_layers is all True without experts
    f = moe.ffn_hidden_size
    groups: list[dict[str, tuple[int, ...]]] = [{moe.router_name(layer): (moe.num_experts, h)}]
    for expert in range(moe.num_experts):
        gate, up, down = moe.expert_names(layer, expert)
        groups += [{gate: (f, h), up: (f, h)}, {down: (h, f)}]
    return groups


def _hf_groups(arch: Architecture) -> list[dict[str, tuple[int, ...]]]:
    """Every HF tensor of `arch` with its full shape, in HF module order, grouped by the megatron
    parameter built from them (q/k/v together, gate/up together, others alone)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_query_groups * d
    groups: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (arch.vocab_size, h)}]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        groups.append({p + "input_layernorm.weight": (h,)})
        groups.append(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
            }
        )
        if arch.qkv_bias:
            groups.append(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if arch.qk_layernorm:
            groups.append({p + "self_attn.q_norm.weight": (d,)})
            groups.append({p + "self_attn.k_norm.weight": (d,)})
        groups.append({p + "self_attn.o_proj.weight": (h, q)})
        groups.append({p + "post_attention_layernorm.weight": (h,)})
        groups += _mlp_groups(arch, i)
    groups.append({"model.norm.weight": (h,)})
    # a tied checkpoint needs no `lm_head` (some store a copy: `HFBridge` skips and re-exports it)
    if not arch.tied_embeddings:
        groups.append({"lm_head.weight": (arch.vocab_size, h)})
    return groups


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of ``arch`` and its full shape, in HF module order."""
    return {name: shape for group in _hf_groups(arch) for name, shape in group.items()}


def hf_name_groups(arch: Architecture) -> dict[str, tuple[str, ...]]:
    """First HF name -> the HF names one megatron parameter gives, every group in HF module order."""
    return {next(iter(group)): tuple(group) for group in _hf_groups(arch)}


def _part(size: int, rank: int, world: int) -> slice:
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def read_shard(
    reader: SafetensorsReader, pm: ParamMap, arch: Architecture, rank: int, world: int
) -> torch.Tensor:
    """This TP rank's megatron tensor for ``pm``, reading only its slices from disk."""
    if pm.layout == "replicated":
        return reader.read(pm.hf_names[0])
    if pm.layout == "dim0":
        rows = _part(reader.shape(pm.hf_names[0])[0], rank, world)
        return reader.read(pm.hf_names[0], rows=rows)
    if pm.layout == "dim1":
        cols = _part(reader.shape(pm.hf_names[0])[1], rank, world)
        return reader.read(pm.hf_names[0], cols=cols)
    if pm.layout == "fc1":  # dense MLP (F) or expert (F_e) width
        rows = _part(reader.shape(pm.hf_names[0])[0], rank, world)
        return torch.cat([reader.read(n, rows=rows) for n in pm.hf_names])
    # qkv: this rank's groups [g0, g0 + groups), each [q rows of the group; k rows; v rows]
    # megatron interleaves q, k, v by query group, so TP splits the groups: a rank reads its groups'
    # rows of each of q, k and v
    d, groups = arch.head_dim, arch.num_query_groups // world
    per_group_q = arch.num_heads // arch.num_query_groups * d
    g0 = rank * groups
    q_name, k_name, v_name = pm.hf_names
    q = reader.read(q_name, rows=slice(g0 * per_group_q, (g0 + groups) * per_group_q))
    k = reader.read(k_name, rows=slice(g0 * d, (g0 + groups) * d))
    v = reader.read(v_name, rows=slice(g0 * d, (g0 + groups) * d))
    rest = q.shape[1:]
    parts = [q.reshape(groups, per_group_q, *rest)]
    parts += [x.reshape(groups, d, *rest) for x in (k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def merge_shards(
    pm: ParamMap, shards: Sequence[torch.Tensor], arch: Architecture
) -> list[torch.Tensor]:
    """Inverse of `read_shard`: the HF tensors (in `pm.hf_names` order) from all TP ranks' shards."""
    if pm.layout == "replicated":
        return [shards[0]]
    if pm.layout in ("dim0", "dim1"):
        return [torch.cat(list(shards), dim=0 if pm.layout == "dim0" else 1)]
    if pm.layout == "fc1":
        # each rank holds [gate_r; up_r]: the full gate is the ranks' first halves, the full up
        # their second
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    d, groups = arch.head_dim, arch.num_query_groups
    per_group_q = arch.num_heads // arch.num_query_groups * d
    full = torch.cat(list(shards), dim=0)
    rest = full.shape[1:]
    q, k, v = full.reshape(groups, per_group_q + 2 * d, *rest).split([per_group_q, d, d], dim=1)
    return [x.reshape(-1, *rest) for x in (q, k, v)]
