"""Vocab-parallel log-softmax, token logprobs and entropy over a TP-sharded last dim: TP rank `r`
holds logits `[..., V/TP]` for global ids `[r*V/TP, (r+1)*V/TP)`; results are fp32 (fp64 stays
fp64) and exact, identical on every TP rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_rl.ops._checks import (
    all_reduce,
    check_chunk_size,
    check_token_ids,
    check_vocab_shard,
    compute_dtype,
    group_rank_size,
    seq_chunks,
    upcast,
)
from lightning_mcore_rl.parallel import shard_range

# the chunked kernels walk the sequence dim (-2) in pieces of `chunk_size` tokens, upcast one chunk
# at a time and rematerialise the softmax in backward from the raw logits and the saved `lse` (one
# fp32 value per token), so bf16 logits never exist as a full fp32 copy. The unchunked kernels
# (`chunk_size=None`, `distributed_log_softmax`) upcast the whole input by design
_MAX = dist.ReduceOp.MAX
_SUM = dist.ReduceOp.SUM


def vocab_range_for_rank(global_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """`[vocab_start, vocab_end)` owned by TP rank `tp_rank` under uniform contiguous sharding.

    Raises:
        ValueError: `global_vocab_size % tp_size != 0`, or the rank is out of range.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"`tp_rank` must be in [0, tp_size={tp_size}), got {tp_rank}")
    # a vocab not divisible by TP must be padded, as megatron's `make_vocab_size_divisible_by` does
    if global_vocab_size % tp_size != 0:
        raise ValueError(
            f"vocab size {global_vocab_size} is not divisible by TP = {tp_size}; pad the vocab to "
            f"a multiple of TP (Megatron's `make_vocab_size_divisible_by`)"
        )
    return shard_range(global_vocab_size // tp_size, tp_rank)


def global_logsumexp(z: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """`log sum_v exp z_v` over the full (TP-sharded) vocab: `z [..., V/TP]` fp32 -> `[...]`."""
    z_max = z.amax(dim=-1, keepdim=True)
    all_reduce(z_max, tp_group, _MAX)
    sum_exp = (z - z_max).exp_().sum(dim=-1, keepdim=True)
    all_reduce(sum_exp, tp_group, _SUM)
    return (z_max + sum_exp.log()).squeeze(-1)


def localise_ids(
    ids: torch.Tensor, vocab_start: int, vocab_end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(owned, local)`: which global `ids` this shard owns, and their local column (0 if not)."""
    owned = (ids >= vocab_start) & (ids < vocab_end)
    local = torch.where(owned, ids - vocab_start, torch.zeros_like(ids)).long()
    return owned, local


class _DistributedLogSoftmax(torch.autograd.Function):
    """`logits [..., V/TP]` -> fp32 `logp [..., V/TP]`."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
        z = upcast(logits)
        logp = z - global_logsumexp(z, tp_group).unsqueeze(-1)
        ctx.save_for_backward(logp)
        ctx.tp_group = tp_group
        ctx.logits_dtype = logits.dtype
        return logp

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (logp,) = ctx.saved_tensors
        # dL/dz_v = g_v - p_v * sum_u g_u: the sum runs over the full vocab, the backward's one
        # all-reduce
        grad_sum = grad_output.sum(dim=-1, keepdim=True)
        all_reduce(grad_sum, ctx.tp_group, _SUM)
        grad = grad_output - logp.exp() * grad_sum
        return grad.to(ctx.logits_dtype), None


def distributed_log_softmax(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Differentiable log-softmax of vocab-parallel `logits [..., V/TP]` -> fp32 `[..., V/TP]`.

    Raises:
        ValueError: `logits` is not floating point.
    """
    group_rank_size(tp_group, "tp_group")
    if not logits.is_floating_point():
        raise ValueError(f"`logits` must be a floating-point tensor, got dtype {logits.dtype}")
    return _DistributedLogSoftmax.apply(logits, tp_group)


class _DistributedLogprob(torch.autograd.Function):
    """Logprob `[...]` fp32 of one global `target [...]` id per token under `logits [..., V/TP]`,
    unchunked (saves the fp32 softmax)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        vocab_end: int,
        tp_group: Any,
    ) -> torch.Tensor:
        z = upcast(logits)
        owned, local = localise_ids(target, vocab_start, vocab_end)
        z_max = z.amax(dim=-1, keepdim=True)
        all_reduce(z_max, tp_group, _MAX)
        probs = (z - z_max).exp_()  # unnormalised, becomes the softmax below (in place)
        sum_exp = probs.sum(dim=-1, keepdim=True)
        all_reduce(sum_exp, tp_group, _SUM)
        lse = (z_max + sum_exp.log()).squeeze(-1)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) - lse
        # z_y - lse on the shard owning y, 0 elsewhere: the SUM over TP hands every rank the owner's
        # value
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        all_reduce(picked, tp_group, _SUM)
        probs.div_(sum_exp)
        ctx.save_for_backward(probs, local, owned)
        ctx.logits_dtype = logits.dtype
        ctx.backward_done = False
        return picked

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.backward_done:
            raise RuntimeError(
                "the unchunked DistributedLogprob backward reuses its saved softmax in place and "
                "can run only once; pass a `chunk_size` to use the chunked kernel with "
                "retain_graph=True"
            )
        ctx.backward_done = True
        probs, local, owned = ctx.saved_tensors
        g = upcast(grad_output)
        # dL/dz_v = g * (1[v == y and owned] - p_v), local only: the forward SUM's backward is the
        # identity on a TP-replicated upstream gradient. The saved softmax becomes the gradient in
        # place (as megatron's cross entropy does), hence the single backward
        grad = probs.mul_(-g.unsqueeze(-1))
        grad.scatter_add_(-1, local.unsqueeze(-1), torch.where(owned, g, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def _workspace(logits: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """One reusable compute-dtype buffer `[..., chunk, V/TP]`."""
    # one buffer for every chunk: fresh pages are touched once, not once per chunk
    rows = logits.shape[-2] if chunk_size is None else min(chunk_size, logits.shape[-2])
    shape = (*logits.shape[:-2], rows, logits.shape[-1])
    return torch.empty(shape, dtype=compute_dtype(logits.dtype), device=logits.device)


class _ChunkedDistributedGatherLogprob(torch.autograd.Function):
    """Full-vocab logprobs `[..., S, K]` fp32 at `ids [..., S, K]` under `logits [..., S, V/TP]`,
    chunked along `S`; saves the raw logits, the ids and `lse [..., S]`, never a softmax."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        ids: torch.Tensor,
        vocab_start: int,
        vocab_end: int,
        chunk_size: int | None,
        tp_group: Any,
    ) -> torch.Tensor:
        owned, local = localise_ids(ids, vocab_start, vocab_end)
        seq_len = logits.shape[-2]
        out = torch.empty(ids.shape, dtype=compute_dtype(logits.dtype), device=logits.device)
        lse = torch.empty(logits.shape[:-1], dtype=out.dtype, device=logits.device)
        work = _workspace(logits, chunk_size)
        for start, stop in seq_chunks(seq_len, chunk_size):
            n = stop - start
            z = work.narrow(-2, 0, n)
            z.copy_(logits.narrow(-2, start, n))  # the per-chunk upcast, into a reused buffer
            picked = z.gather(-1, local.narrow(-2, start, n))
            z_max = z.amax(dim=-1, keepdim=True)
            all_reduce(z_max, tp_group, _MAX)
            sum_exp = z.sub_(z_max).exp_().sum(dim=-1, keepdim=True)
            all_reduce(sum_exp, tp_group, _SUM)
            chunk_lse = z_max.add_(sum_exp.log_())
            lse.narrow(-1, start, n).copy_(chunk_lse.squeeze(-1))
            out.narrow(-2, start, n).copy_(picked.sub_(chunk_lse))
        out = torch.where(owned, out, torch.zeros_like(out))
        all_reduce(out, tp_group, _SUM)
        ctx.save_for_backward(logits, local, owned, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, owned, lse = ctx.saved_tensors
        g = upcast(grad_output)
        g_owned = torch.where(owned, g, 0.0)
        g_sum = g.sum(dim=-1, keepdim=True)  # [..., S, 1]
        grad = torch.empty_like(logits)
        work = _workspace(logits, ctx.chunk_size)
        for start, stop in seq_chunks(logits.shape[-2], ctx.chunk_size):
            n = stop - start
            probs = work.narrow(-2, 0, n)
            probs.copy_(logits.narrow(-2, start, n))
            probs.sub_(lse.narrow(-1, start, n).unsqueeze(-1)).exp_()
            # dL/dz_v = -p_v * sum_k g_k + sum_k g_k 1[v == id_k and owned], p recomputed as exp(z -
            # lse); no collective
            probs.mul_(-g_sum.narrow(-2, start, n))
            probs.scatter_add_(-1, local.narrow(-2, start, n), g_owned.narrow(-2, start, n))
            # each chunk's fp32 gradient is written into one gradient in the logits' dtype: for bf16
            # logits one rounding per element, the same one the backward of an fp32 upcast
            # (megatron's `Float16Module`) applies, so deferred bf16 logits (`train.logits_dtype`)
            # get the fp32-logit path's gradient bitwise
            grad.narrow(-2, start, n).copy_(probs)
        return grad, None, None, None, None, None


def _check_ids_against_logits(
    logits: torch.Tensor, ids: torch.Tensor, tp_size: int, name: str, trailing: int
) -> None:
    lead = tuple(logits.shape[:-1])
    if tuple(ids.shape[: ids.dim() - trailing]) != lead or ids.dim() != len(lead) + trailing:
        expected = f"{list(lead)}" if trailing == 0 else f"{list(lead)} + [K]"
        raise ValueError(
            f"`{name}` must have shape {expected} to match `logits` {tuple(logits.shape)}, got "
            f"{tuple(ids.shape)}"
        )
    check_token_ids(ids, logits.shape[-1] * tp_size, name)


def distributed_logprob(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    inference_only: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Logprob `[..., S]` fp32 of each token's global `target [..., S]` under this rank's vocab
    shard `logits [..., S, V/TP]` (`DistributedLogprob`), identical on every TP rank.

    Args:
        inference_only: run without autograd (nothing saved for backward).
        chunk_size: tokens per chunk along `S`; `None`: the unchunked kernel.

    Raises:
        ValueError: shapes, ids, shard bounds or `chunk_size` do not match.
    """
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    _check_ids_against_logits(logits, target, tp_size, "target", trailing=0)
    check_chunk_size(chunk_size)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not inference_only):
        if chunk_size is None:
            return _DistributedLogprob.apply(
                logits, target, vocab_start_index, vocab_end_index, tp_group
            )
        return _ChunkedDistributedGatherLogprob.apply(
            logits, target.unsqueeze(-1), vocab_start_index, vocab_end_index, chunk_size, tp_group
        ).squeeze(-1)


def distributed_logprobs_at_indices(
    logits: torch.Tensor,
    indices: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Full-vocab logprobs `[..., S, K]` fp32 at global `indices [..., S, K]` under
    `logits [..., S, V/TP]` (`ChunkedDistributedGatherLogprob`; `chunk_size=None`: one chunk).

    Raises:
        ValueError: shapes, ids, shard bounds or `chunk_size` do not match.
    """
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    _check_ids_against_logits(logits, indices, tp_size, "indices", trailing=1)
    check_chunk_size(chunk_size)
    return _ChunkedDistributedGatherLogprob.apply(
        logits, indices, vocab_start_index, vocab_end_index, chunk_size, tp_group
    )


class _ChunkedDistributedEntropy(torch.autograd.Function):
    """Entropy `[..., S]` fp32 (>= 0) of `logits [..., S, V/TP]`, chunked along `S`."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, chunk_size: int | None, tp_group: Any
    ) -> torch.Tensor:
        lse = torch.empty(
            logits.shape[:-1], dtype=compute_dtype(logits.dtype), device=logits.device
        )
        entropy = torch.empty_like(lse)
        for start, stop in seq_chunks(logits.shape[-2], chunk_size):
            z = upcast(logits.narrow(-2, start, stop - start))
            chunk_lse = global_logsumexp(z, tp_group)
            logp = z - chunk_lse.unsqueeze(-1)
            lse.narrow(-1, start, stop - start).copy_(chunk_lse)
            entropy.narrow(-1, start, stop - start).copy_(-(logp.exp() * logp).sum(dim=-1))
        all_reduce(entropy, tp_group, _SUM)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.chunk_size = chunk_size
        return entropy

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, lse, entropy = ctx.saved_tensors
        g = upcast(grad_output)
        grad = torch.empty_like(logits)
        for start, stop in seq_chunks(logits.shape[-2], ctx.chunk_size):
            n = stop - start
            logp = upcast(logits.narrow(-2, start, n)) - lse.narrow(-1, start, n).unsqueeze(-1)
            # dH/dz_v = -p_v (log p_v + H) times g, recomputed per chunk from the saved logits, lse
            # and H; no collective
            weight = (logp + entropy.narrow(-1, start, n).unsqueeze(-1)).mul_(logp.exp_())
            grad.narrow(-2, start, n).copy_(weight.mul_(-g.narrow(-1, start, n).unsqueeze(-1)))
        return grad, None, None


def vocab_parallel_entropy(
    logits: torch.Tensor, tp_group: Any, chunk_size: int | None = None
) -> torch.Tensor:
    """Per-token entropy `-sum_v p_v log p_v`, `[..., S]` fp32 (>= 0), of vocab-parallel
    `logits [..., S, V/TP]`, differentiable (`chunk_size=None`: one chunk).

    Raises:
        ValueError: `logits` is not a floating-point `[..., S, V/TP]` tensor, or a bad `chunk_size`.
    """
    group_rank_size(tp_group, "tp_group")
    if not logits.is_floating_point() or logits.dim() < 2:
        raise ValueError(
            f"`logits` must be a floating-point [..., S, V_l] tensor, got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    check_chunk_size(chunk_size)
    # the positive entropy: the reference's `H_all` in distillation is the negative one, sum p log p
    return _ChunkedDistributedEntropy.apply(logits, chunk_size, tp_group)
