"""Helpers for multi-rank ops tests: TP x CP gloo groups and plain-torch fp32 references."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mcore_rl.ops import get_tokens_on_this_cp_rank


def build_groups(tp: int, cp: int) -> tuple[Any, Any, int, int]:
    """``(tp_group, cp_group, tp_rank, cp_rank)`` for world rank ``cp_rank * tp + tp_rank``."""
    rank = dist.get_rank()
    tp_group = cp_group = None
    for c in range(cp):
        ranks = [c * tp + t for t in range(tp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp):
        ranks = [c * tp + t for c in range(cp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            cp_group = group
    return tp_group, cp_group, rank % tp, rank // tp


def shard(full: torch.Tensor, tp_rank: int, tp: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's ``[B, S/CP, V/TP]`` slice of dense ``full [B, S, V]``."""
    local_vocab = full.shape[-1] // tp
    seq = get_tokens_on_this_cp_rank(full, cp_rank, cp, seq_dim=1)
    return seq[..., tp_rank * local_vocab : (tp_rank + 1) * local_vocab]


def shard_packed(
    full: torch.Tensor, cu: list[int], tp_rank: int, tp: int, cp_rank: int, cp: int
) -> torch.Tensor:
    """This rank's ``[1, T/CP, V/TP]`` slice of packed ``full [1, T, V]`` (per-sequence zigzag)."""
    pieces = [
        get_tokens_on_this_cp_rank(full[:, a:b], cp_rank, cp, seq_dim=1)
        for a, b in zip(cu[:-1], cu[1:], strict=True)
    ]
    seq = torch.cat(pieces, dim=1)
    local_vocab = full.shape[-1] // tp
    return seq[..., tp_rank * local_vocab : (tp_rank + 1) * local_vocab]


def ref_next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain fp32 reference: ``log_softmax(logits[:, :-1]).gather(ids[:, 1:])`` -> ``[B, S-1]``."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def ref_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Independent reference filter: keep top-k, then tokens whose higher-ranked mass is < p."""
    out = logits.clone()
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        out = out.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        desc, order = out.sort(dim=-1, descending=True)
        probs = desc.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, mass_above >= top_p)
        out = out.masked_fill(drop, float("-inf"))
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference (0 for empty tensors)."""
    return 0.0 if a.numel() == 0 else float((a.detach().float() - b.detach().float()).abs().max())
