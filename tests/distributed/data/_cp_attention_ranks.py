"""Rank function of the CP attention test: ``PackedDotProductAttention`` on CP=2 (real gloo
groups, megatron's parallel state) against plain per-span causal attention on the full row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

SPANS = [8, 12, 0, 12]  # multiples of 2*CP = 4 (an empty span included)
HEADS, GROUPS, HEAD_DIM = 4, 2, 8  # grouped-query attention: 2 heads per key/value group


@dataclass(frozen=True)
class CPAttentionResult:
    """One CP rank: max |CP - reference| of the output and of each input's gradient (this rank's
    shard), the gather function's checks, and the error messages of bad inputs."""

    diffs: dict[str, float]
    gather_forward_diff: float
    gather_grad_diff: float
    gradcheck: bool
    errors: dict[str, str]


def full_inputs(spans: list[int] = SPANS) -> dict[str, torch.Tensor]:
    """Full packed ``q [T, np, hn]``, ``k/v [T, ng, hn]`` and the output weight ``[T, np*hn]``
    (float64, CPU)."""
    g = torch.Generator().manual_seed(0)
    total = sum(spans)
    shapes = {"q": (HEADS,), "k": (GROUPS,), "v": (GROUPS,)}
    out = {n: torch.randn(total, *s, HEAD_DIM, generator=g, dtype=torch.float64)
           for n, s in shapes.items()}  # fmt: skip
    out["w"] = torch.randn(total, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    return out


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[int] = SPANS
) -> torch.Tensor:
    """Causal attention within each span, written out: ``softmax(q k^T / sqrt(hn) + causal) v``
    per span, key/value groups repeated to the heads. ``[T, np, hn]`` -> ``[T, np*hn]``."""
    k, v = (x.repeat_interleave(HEADS // GROUPS, dim=1) for x in (k, v))
    pieces, start = [], 0
    for length in spans:
        end = start + length
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) / math.sqrt(HEAD_DIM)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, v[start:end]))
        start = end
    return torch.cat(pieces).reshape(q.shape[0], -1)


def _attention() -> torch.nn.Module:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from lightning_mcore_rl.models.layers import PackedDotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        num_query_groups=GROUPS, context_parallel_size=2, attention_dropout=0.0,
    )  # fmt: skip
    return PackedDotProductAttention(config, 1, AttnMaskType.causal, "self")


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except ValueError as err:
        return str(err)
    return ""


def packed_params(spans: list[int], device: torch.device | str = "cpu") -> PackedSeqParams:
    """megatron ``PackedSeqParams`` (THD) of one packed row of ``spans`` (global boundaries)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                           max_seqlen_q=max(spans), max_seqlen_kv=max(spans))  # fmt: skip


def cp_attention_rank(rank: int) -> CPAttentionResult:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from lightning_mcore_rl.data import cp_local_indices
    from lightning_mcore_rl.data.packed_checks import check_packed_core_attention
    from lightning_mcore_rl.ops.context_parallel import (
        _AllGatherToPositions,
        allgather_cp_to_positions,
    )
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state(context_parallel_size=2)
    from megatron.core import parallel_state as ps

    cp_group, cp = ps.get_context_parallel_group(), 2
    params = packed_params(SPANS)
    cu = params.cu_seqlens_q
    full = full_inputs()
    leaves = {n: full[n].clone().requires_grad_() for n in "qkv"}
    ref_out = reference_attention(leaves["q"], leaves["k"], leaves["v"])
    (ref_out * full["w"]).sum().backward()

    mine = cp_local_indices(cu, rank, cp)
    local = {n: full[n][mine].clone().requires_grad_() for n in "qkv"}
    attention = _attention()
    out = attention(local["q"], local["k"], local["v"], None, packed_seq_params=params)
    # sum over CP ranks of the local losses = the full loss: each rank's gradients are its shard
    (out * full["w"][mine]).sum().backward()
    diffs = {"out": float((out.detach() - ref_out.detach()[mine]).abs().max())}
    for n in "qkv":
        grad = local[n].grad
        assert grad is not None and leaves[n].grad is not None
        diffs[f"d{n}"] = float((grad - leaves[n].grad[mine]).abs().max())

    # the gather alone: forward is the full row; backward with rank-dependent weights w_r sums
    # every rank's weight at this rank's positions
    positions = torch.cat([cp_local_indices(cu, r, cp) for r in range(cp)])
    x = full["k"][mine].clone().requires_grad_()
    gathered = allgather_cp_to_positions(x, positions, cp_group)
    weights = [torch.full_like(full["k"], r + 1.0) * full["k"] for r in range(cp)]
    (gathered * weights[rank]).sum().backward()
    assert x.grad is not None
    gather_grad = float((x.grad - sum(weights)[mine]).abs().max())
    # gradcheck in float64 on this rank's own one-rank group (a nontrivial permutation)
    solo = [dist.new_group([r]) for r in range(cp)][rank]
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    ok = torch.autograd.gradcheck(lambda t: _AllGatherToPositions.apply(t, perm, solo), (probe,))

    errors = {
        "padded_under_cp": _error(lambda: attention(
            *(t.detach()[:, None] for t in (local["q"], local["k"], local["v"])), None)),
        "odd_span": _error(lambda: attention(
            local["q"].detach(), local["k"].detach(), local["v"].detach(), None,
            packed_seq_params=PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 32], dtype=torch.int32),
                cu_seqlens_kv=torch.tensor([0, 2, 32], dtype=torch.int32)))),
        "positions": _error(lambda: allgather_cp_to_positions(x, positions[:-1], cp_group)),
    }  # fmt: skip
    init_megatron_state()  # CP=1: megatron's local DotProductAttention refuses CP > 1
    attention = torch.nn.Module()  # a self-attention layer holding megatron's local core attention
    attention.core_attention = DotProductAttention(_local_config(), 1, AttnMaskType.causal, "self")
    local_model = torch.nn.Sequential(attention)
    errors["local_spec"] = _error(lambda: check_packed_core_attention(local_model))
    return CPAttentionResult(
        diffs=diffs,
        gather_forward_diff=float((gathered.detach() - full["k"]).abs().max()),
        gather_grad_diff=gather_grad,
        gradcheck=ok,
        errors=errors,
    )


def _local_config() -> object:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS)
