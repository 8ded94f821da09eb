"""Training-time sampling parameters and top-k / top-p filtered logprobs over TP-sharded logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_rl.ops._checks import (
    check_chunk_size,
    check_vocab_shard,
    compute_dtype,
    seq_chunks,
    upcast,
)

# filtering needs whole vocab rows: the kernel turns vocab-parallel [N, V/TP] into row-parallel
# [N/TP, V] with one all-to-all, filters and log-softmaxes full rows and all-gathers the per-token
# results; the backward sends row gradients back with the inverse all-to-all. Temperature is NOT
# applied here: the logits come temperature-scaled (`train.apply_temperature_scaling`), so filtering
# follows temperature, as at generation time
from lightning_mcore_rl.ops.vocab_parallel import _check_ids_against_logits


@dataclass(frozen=True)
class TrainingSamplingParams:
    """The generation-time sampling settings the training logprobs must reproduce.

    Attributes:
        temperature: logits are divided by it before any filtering (> 0).
        top_k: keep the `top_k` largest logits per token (`None`: no top-k filter).
        top_p: keep the smallest set of top tokens whose mass reaches `top_p` (`1.0`: no filter).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"`temperature` must be > 0, got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k <= 0):
            raise ValueError(f"`top_k` must be a positive int or None, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}")

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p filtering is active."""
        return self.top_k is not None or self.top_p < 1.0


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: int | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-style filtering of full-vocab rows `[N, V]` fp32: top-k, then top-p on the survivors;
    returns `(filtered [N, V], keep [N, V] bool)` with `-inf` at filtered positions."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None and top_k < logits.shape[-1]:
        # keeps every logit >= the k-th largest: ties are kept
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        keep &= logits >= kth_largest
    if top_p < 1.0:
        survivors = logits.masked_fill(~keep, float("-inf"))
        # drop the survivors whose ascending cumulative probability is <= 1 - top_p, always keeping
        # the largest
        ascending, order = survivors.sort(dim=-1)
        drop_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False
        keep &= ~torch.zeros_like(keep).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(~keep, float("-inf")), keep


def _vocab_to_rows(x: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """All-to-all `[n, V/TP]` vocab-parallel -> `[n/TP, V]` row-parallel (rank r: rows block r)."""
    tp = tp_group.size()
    if tp == 1:
        return x
    n, local_vocab = x.shape
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=tp_group)
    # out holds TP blocks [n/TP, V_l]: block j = vocab shard j of this rank's rows
    return out.view(tp, n // tp, local_vocab).permute(1, 0, 2).reshape(n // tp, tp * local_vocab)


def _rows_to_vocab(y: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Inverse of `_vocab_to_rows`: `[n/TP, V]` -> `[n, V/TP]`."""
    tp = tp_group.size()
    if tp == 1:
        return y
    rows, vocab = y.shape
    blocks = y.view(rows, tp, vocab // tp).permute(1, 0, 2).contiguous()  # [TP, n/TP, V_l]
    out = torch.empty_like(blocks)
    dist.all_to_all_single(out, blocks, group=tp_group)
    return out.view(rows * tp, vocab // tp)


class _ChunkedDistributedLogprobWithSampling(torch.autograd.Function):
    """Top-k/top-p filtered logprobs `[B, S]` fp32 of `logits [B, S, V/TP]` at global
    `target [B, S]`, chunked along `S` (`-inf` where the target was filtered out); saves only the
    raw logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        top_k: int | None,
        top_p: float,
        chunk_size: int | None,
        tp_group: Any,
    ) -> torch.Tensor:
        out = torch.empty(target.shape, dtype=compute_dtype(logits.dtype), device=logits.device)
        for start, stop in seq_chunks(logits.shape[1], chunk_size):
            logp, _, rows_target = _filtered_rows(
                logits, target, start, stop, top_k, top_p, tp_group
            )
            picked = logp.gather(-1, rows_target.unsqueeze(-1)).squeeze(-1)
            # saves only the raw logits: the filtered softmax is recomputed per chunk in backward
            out[:, start:stop] = _gather_rows(picked, tp_group).view(logits.shape[0], stop - start)
        ctx.save_for_backward(logits, target)
        ctx.params = (top_k, top_p, chunk_size, tp_group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, target = ctx.saved_tensors
        top_k, top_p, chunk_size, tp_group = ctx.params
        grad = torch.empty_like(logits)
        batch, _, local_vocab = logits.shape
        for start, stop in seq_chunks(logits.shape[1], chunk_size):
            logp, keep, rows_target = _filtered_rows(
                logits, target, start, stop, top_k, top_p, tp_group
            )
            g = _my_rows(upcast(grad_output[:, start:stop]).reshape(-1), tp_group)
            # dL/dz_v = g * (1[v == y] - p_v) * keep_v on row-parallel rows (p the filtered softmax,
            # recomputed per chunk), then all-to-all back to [B*c, V/TP]
            rows_grad = logp.exp_().mul_(-g.unsqueeze(-1))
            rows_grad.scatter_add_(-1, rows_target.unsqueeze(-1), g.unsqueeze(-1))
            rows_grad.mul_(keep)
            grad[:, start:stop] = _rows_to_vocab(rows_grad.to(logits.dtype), tp_group).view(
                batch, stop - start, local_vocab
            )
        return grad, None, None, None, None, None


def _gather_rows(local: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """All-gather every TP rank's row block `[n/TP]` -> `[n]` (inverse of `_my_rows`)."""
    if tp_group.size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_group.size())]
    dist.all_gather(parts, local, group=tp_group)
    return torch.cat(parts)


def _my_rows(flat: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """This TP rank's contiguous block `[n/TP]` of `flat [n]`."""
    rows = flat.shape[0] // tp_group.size()
    return flat[tp_group.rank() * rows : (tp_group.rank() + 1) * rows]


def _filtered_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    stop: int,
    top_k: int | None,
    top_p: float,
    tp_group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(log_softmax(filtered) [n/TP, V], keep [n/TP, V], target [n/TP])` for seq `[start, stop)`."""
    chunk = logits[:, start:stop].reshape(-1, logits.shape[-1])  # [B*c, V_l]
    rows = upcast(_vocab_to_rows(chunk, tp_group))  # [B*c/TP, V]
    filtered, keep = apply_top_k_top_p(rows, top_k, top_p)
    rows_target = _my_rows(target[:, start:stop].reshape(-1), tp_group).long()
    return filtered.log_softmax(dim=-1), keep, rows_target


def distributed_logprob_with_sampling(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    sampling_params: TrainingSamplingParams,
    inference_only: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Logprobs `[B, S]` fp32 of global `target [B, S]` under top-k/top-p filtering of the
    temperature-scaled vocab shard `logits [B, S, V/TP]` (`DistributedLogprobWithSampling`); `-inf`
    where the target was filtered out.

    Raises:
        ValueError: `B*S` or `B*chunk` not divisible by TP, or the checks of `distributed_logprob`.
    """
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    if logits.dim() != 3:
        raise ValueError(f"`logits` must be [B, S, V_l], got shape {tuple(logits.shape)}")
    _check_ids_against_logits(logits, target, tp_size, "target", trailing=0)
    check_chunk_size(chunk_size)
    batch, seq = target.shape
    # each chunk's B*c rows are split over TP by the all-to-all
    for start, stop in seq_chunks(seq, chunk_size):
        if batch * (stop - start) % tp_size != 0:
            what = "B*S" if chunk_size is None else f"B*chunk (chunk [{start}, {stop}))"
            raise ValueError(
                f"top-k/top-p logprobs need {what} = {batch * (stop - start)} divisible by TP = "
                f"{tp_size}; set `make_sequence_length_divisible_by` to a multiple of TP or pick "
                f"a `chunk_size` that keeps every chunk divisible"
            )
    with torch.set_grad_enabled(torch.is_grad_enabled() and not inference_only):
        return _ChunkedDistributedLogprobWithSampling.apply(
            logits, target, sampling_params.top_k, sampling_params.top_p, chunk_size, tp_group
        )
