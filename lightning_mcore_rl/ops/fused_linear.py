"""Fused LM head + logprobs: token logprobs (and entropy) of `hidden @ weight.T / temperature`
without materialising the logits (at most one fp32 `[chunk, V/TP]` block at a time). `weight` is
the `[V/TP, H]` shard of a column-parallel output layer; `hidden` is replicated over TP."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.distributed as dist

from lightning_mcore_rl.ops._checks import (
    all_reduce,
    check_chunk_size,
    check_ndim,
    check_token_ids,
    check_vocab_shard,
    compute_dtype,
    group_rank_size,
    seq_chunks,
    upcast,
)
from lightning_mcore_rl.ops.logprobs import (
    check_dense_layout,
    check_packed_target,
    normalise_cu_seqlens,
    run_dense,
    run_packed,
)
from lightning_mcore_rl.ops.sampling import TrainingSamplingParams
from lightning_mcore_rl.ops.vocab_parallel import global_logsumexp, localise_ids

# the forward walks the tokens in chunks; the backward recomputes logits in blocks of the same size
# walking vocab rows instead (all tokens, n rows), so each block of the weight gradient is written
# once and no fp32 [V/TP, H] accumulator is needed. Top-k/top-p filtering needs whole vocab rows and
# is not fused: use the logits path (`from_parallel_logits_to_logprobs`)
_SUM = dist.ReduceOp.SUM
_DEFAULT_CHUNK_BYTES = 64 * 2**20  # one fp32 [chunk, V_l] block of logits
_PREDICTION_RTOL = 1e-5
"""How far (relative to its largest entry) the logprob gradient the backward receives may be
from ``scale x`` the predicted one for the forward's gradients to stand: the two are the same
autograd formulas evaluated on the same values (measured <= 2 ulp apart, ~2.4e-7), so this only
separates rounding from a loss that is not token-local."""

# gradient in the forward: when the loss's gradient at token t depends on token t's logprob only,
# the forward computes the head's gradients from each logits block while it exists and the backward
# recomputes nothing (three GEMMs of the head per step instead of four, for an fp32 [V/TP, H]
# accumulator held until the backward). The backward checks the received gradient against the
# prediction (up to the schedule's loss scaling) and warns and recomputes where they differ, so the
# gradients are always the loss's own
LogprobGradient = Callable[[torch.Tensor], torch.Tensor]
"""``gradient(logprobs [T]) -> dL/dlogprobs [T]`` for the head's gradient in the forward: called
after each chunk with the logprobs computed so far (0 where not yet computed); entries of the
finished chunk must be final (a token-local loss)."""


class GradientPredictionWarning(UserWarning):
    """The logprob gradient a fused head received was not the one its forward predicted (the loss
    is not token-local): its backward recomputed the logits."""


class FusedLinearLogprobsOutput(NamedTuple):
    """`fused_linear_logprobs`' outputs: `logprobs [T]` fp32 and `entropy [T]` fp32 (or `None`)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, start: int, stop: int, temperature: float
) -> torch.Tensor:
    """fp32 `[stop-start, V/TP]` block `hidden[start:stop] @ weight.T / temperature`."""
    z = upcast(torch.matmul(hidden[start:stop], weight.t()))
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedLinearLogprobs(torch.autograd.Function):
    """`hidden [T, H]`, `weight [V/TP, H]`, `target [T]` -> `(logprob [T], entropy [T])` fp32 of
    `z = h W^T / tau`, chunked over tokens; saves `lse` and `H`, never `z`."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        chunk_size: int,
        temperature: float,
        with_entropy: bool,
        tp_group: Any,
        logprob_gradient: LogprobGradient | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owned, local = localise_ids(target, vocab_start, vocab_start + weight.shape[0])
        tokens = hidden.shape[0]
        logprobs = torch.zeros(tokens, dtype=compute_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.zeros(
            tokens if with_entropy else 0, dtype=logprobs.dtype, device=hidden.device
        )
        in_forward = _ForwardGradients(hidden, weight) if logprob_gradient is not None else None
        for start, stop in seq_chunks(tokens, chunk_size):
            z = _chunk_logits(hidden, weight, start, stop, temperature)
            chunk_lse = global_logsumexp(z, tp_group)
            lse[start:stop] = chunk_lse
            z.sub_(chunk_lse.unsqueeze(-1))  # z is now log p, in place
            logprobs[start:stop] = z.gather(-1, local[start:stop].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[start:stop] = -(z.exp() * z).sum(dim=-1)
            if in_forward is not None:
                assert logprob_gradient is not None
                chunk = logprobs[start:stop]
                # with a predicted gradient each chunk's logprobs are all-reduced over TP as they
                # are made, so the loss's gradient of the chunk can be predicted from them
                chunk.copy_(torch.where(owned[start:stop], chunk, torch.zeros_like(chunk)))
                all_reduce(chunk, tp_group, _SUM)
                g = logprob_gradient(logprobs)[start:stop]  # [0, stop) final, the rest 0
                in_forward.chunk(z, g, owned[start:stop], local[start:stop], start, temperature)
        if in_forward is None:
            # log p_y = z_y - lse where owned, 0 elsewhere: one SUM over TP of each output at the
            # end
            logprobs = torch.where(owned, logprobs, torch.zeros_like(logprobs))
            all_reduce(logprobs, tp_group, _SUM)
        else:
            all_reduce(in_forward.grad_hidden, tp_group, _SUM)
        all_reduce(entropy, tp_group, _SUM)
        ctx.save_for_backward(hidden, weight, local, owned, lse, entropy)
        ctx.params = (chunk_size, temperature, with_entropy, tp_group)
        ctx.in_forward = in_forward
        if not with_entropy:
            # an empty entropy: the backward receives no gradient for it
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local, owned, lse, entropy = ctx.saved_tensors
        chunk_size, temperature, with_entropy, tp_group = ctx.params
        # ctx lets go of the forward's gradients here, so the fp32 [V/TP, H] accumulator is freed
        # with this backward
        in_forward, ctx.in_forward = ctx.in_forward, None
        if in_forward is not None:
            grads = in_forward.finish(upcast(grad_logprobs), hidden.dtype, weight.dtype)
            if grads is not None:
                return *grads, *([None] * 7)
        tokens, local_vocab = hidden.shape[0], weight.shape[0]
        g_lp = upcast(grad_logprobs).unsqueeze(-1)  # [T, 1]
        g_ent = upcast(grad_entropy).unsqueeze(-1) if with_entropy else None
        grad_hidden = torch.zeros(hidden.shape, dtype=g_lp.dtype, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        # Blocks of vocab rows (all tokens) holding as many logits as a forward chunk: each row
        # block of the weight gradient is written exactly once, so no [V_l, H] accumulator exists.
        block = max(1, -(-chunk_size * local_vocab // tokens))
        for start, stop in seq_chunks(local_vocab, block):
            w_block = weight[start:stop]
            logp = upcast(torch.matmul(hidden, w_block.t()))  # [T, n]
            if temperature != 1.0:
                logp.div_(temperature)
            logp.sub_(lse.unsqueeze(-1))
            # dz_v = (g_lp (1[v == y] - p_v) - g_H p_v (log p_v + H)) / tau, then dW[block] = dz^T h
            # and dh += dz W[block]
            dz = logp.exp()
            if g_ent is not None:  # entropy term -g_H p (log p + H), built in the logp buffer
                logp.add_(entropy.unsqueeze(-1)).mul_(dz).mul_(-g_ent)
            dz.mul_(-g_lp)
            in_block = owned & (local >= start) & (local < stop)
            col = torch.where(in_block, local - start, torch.zeros_like(local)).unsqueeze(-1)
            dz.scatter_add_(-1, col, torch.where(in_block.unsqueeze(-1), g_lp, 0.0))
            if g_ent is not None:
                dz.add_(logp)
            if temperature != 1.0:
                dz.div_(temperature)
            dz_w = dz.to(weight.dtype)
            grad_weight[start:stop] = torch.matmul(dz_w.t(), hidden)
            grad_hidden.add_(torch.matmul(dz_w, w_block))
        all_reduce(grad_hidden, tp_group, _SUM)
        # the all-reduce SUM of dh over TP above is the column-parallel input gradient
        return grad_hidden.to(hidden.dtype), grad_weight, *([None] * 7)


_FP32_ACCUMULATION_MAX_TOKENS = 256
"""On CPU, a bf16 weight's gradient over a token chunk shorter than this is accumulated by an
in-place fp32 ``addmm_`` (one pass over the fp32 ``[V_l, H]`` accumulator, an fp32 GEMM), a
longer chunk's by a bf16 product summed in fp32 (three passes, a bf16 GEMM). Measured on the
2-core AMD EPYC VM (avx512_bf16, one thread), fp32 against bf16: 42 vs 64 ms at V=32000, H=512,
128 tokens; 83 vs 78 at 256; 173 vs 119 at 524; 380 vs 553 ms at V=131072, H=1024, 128 tokens.
Both costs scale with ``V_l x H``, so the crossover is a number of tokens. On CUDA the bf16
GEMM's speed wins at any chunk (not measured here)."""


class _ForwardGradients:
    """The head's gradients computed in the forward for a predicted `g_lp`: `grad_hidden [T, H]` and
    `grad_weight [V/TP, H]` fp32, `predicted [T]` fp32."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.hidden, self.weight = hidden, weight
        dtype = compute_dtype(hidden.dtype)
        self.grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        self.grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        self.predicted = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device)

    def chunk(
        self,
        logp: torch.Tensor,
        g: torch.Tensor,
        owned: torch.Tensor,
        local: torch.Tensor,
        start: int,
        temperature: float,
    ) -> None:
        """Tokens `[start, start + n)`: `logp [n, V/TP]` fp32 (consumed: it becomes `dz`), `g [n]`
        their predicted `g_lp`, `owned`/`local [n]` their targets in this shard."""
        stop = start + logp.shape[0]
        g_col = upcast(g).unsqueeze(-1)  # [n, 1]
        self.predicted[start:stop] = g_col.squeeze(-1)
        dz = logp.exp_().mul_(-g_col)  # -g p
        dz.scatter_add_(-1, local.unsqueeze(-1), torch.where(owned.unsqueeze(-1), g_col, 0.0))
        if temperature != 1.0:
            dz.div_(temperature)
        dz_w = dz.to(self.weight.dtype)
        self.grad_hidden[start:stop] = torch.matmul(dz_w, self.weight)
        short = dz.device.type == "cpu" and logp.shape[0] < _FP32_ACCUMULATION_MAX_TOKENS
        if dz_w.dtype == self.grad_weight.dtype or short:
            # dW += dz^T h in place, in fp32 from the fp32 dz (no bf16 rounding of the product)
            self.grad_weight.addmm_(dz.t(), upcast(self.hidden[start:stop]))
        else:  # the product at the bf16 GEMM's speed, summed in fp32
            self.grad_weight.add_(torch.matmul(dz_w.t(), self.hidden[start:stop]))

    def finish(
        self, received: torch.Tensor, hidden_dtype: torch.dtype, weight_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(dh, dW)` for the received `g_lp [T]`, or `None` (warned) when it is not `scale x` the
        prediction."""
        # the backward scales the forward's gradients by the received gradient's ratio to the
        # prediction (the schedule's loss scaling)
        scale = prediction_scale(received, self.predicted)
        if scale is None:
            warnings.warn(
                "The fused LM head received another logprob gradient than the one its forward "
                "predicted (the loss's gradient at a token depends on other tokens' logprobs): "
                "its backward recomputes the logits. A loss that declares "
                "`token_local_gradient = True` must not.",
                GradientPredictionWarning,
                stacklevel=2,
            )
            return None
        grad_hidden, grad_weight = self.grad_hidden, self.grad_weight
        if scale != 1.0:
            grad_hidden.mul_(scale)
            grad_weight.mul_(scale)
        return grad_hidden.to(hidden_dtype), grad_weight.to(weight_dtype)


def prediction_scale(received: torch.Tensor, predicted: torch.Tensor) -> float | None:
    """The `s` with `received ~= s * predicted` (least squares, fp64), or `None` when the residual
    exceeds `_PREDICTION_RTOL` of `max |received|` (one host transfer)."""
    a, p = received.double(), predicted.double()
    pp = torch.dot(p, p)
    scale = torch.where(pp > 0, torch.dot(a, p) / pp.clamp_min(1e-300), torch.zeros_like(pp))
    residual = (a - scale * p).abs().max() if a.numel() else torch.zeros_like(pp)
    bound = _PREDICTION_RTOL * (a.abs().max() if a.numel() else torch.zeros_like(pp))
    scale_value, residual_value, bound_value = torch.stack([scale, residual, bound]).tolist()
    return scale_value if residual_value <= bound_value else None


def _check_fused_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    chunk_size: int | None,
    temperature: float,
) -> int:
    """Validate the LM-head operands; returns `tp_size`."""
    check_ndim(weight, 2, "weight", "[V_l, H]")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: `hidden` {tuple(hidden.shape)} vs `weight` [V_l, H] = "
            f"{tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"dtype mismatch: `hidden` is {hidden.dtype} but `weight` is {weight.dtype}; cast both "
            f"to the model's compute dtype"
        )
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}")
    check_chunk_size(chunk_size)
    # the vocab shard is the weight's rows: check it as if it were logits [..., V_l]
    _, tp_size = check_vocab_shard(
        weight.t(), vocab_start_index, vocab_end_index, tp_group, name="weight"
    )
    return tp_size


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    logprob_gradient: LogprobGradient | None = None,
) -> FusedLinearLogprobsOutput:
    """Logprobs `[T]` fp32 of `target [T]` under
    `softmax(hidden [T, H] @ weight [V/TP, H].T / temperature)`, fused and chunked; gradients flow
    to `hidden` and `weight`.

    Args:
        target: global ids, aligned: `target[t]` is scored by `hidden[t]`.
        chunk_size: tokens per chunk; `None`: the largest whose fp32 logits block fits in 64 MiB.
        return_entropy: also return the differentiable per-token entropy.
        logprob_gradient: the loss's gradient at the logprobs, predicted chunk by chunk (training).

    Raises:
        ValueError: `logprob_gradient` with `return_entropy`; malformed operands.
    """
    check_ndim(hidden, 2, "hidden", "[T, H]")
    tp_size = _check_fused_args(
        hidden, weight, vocab_start_index, vocab_end_index, tp_group, chunk_size, temperature
    )
    if tuple(target.shape) != (hidden.shape[0],):
        raise ValueError(f"`target` must be [T] = [{hidden.shape[0]}], got {tuple(target.shape)}")
    check_token_ids(target, weight.shape[0] * tp_size, "target")
    if logprob_gradient is not None and return_entropy:
        raise ValueError(
            "`logprob_gradient` (gradient in the forward) cannot serve `return_entropy=True`: "
            "the entropy's gradient is not predicted"
        )
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_BYTES // (4 * weight.shape[0]))
    logprobs, entropy = _FusedLinearLogprobs.apply(
        hidden, weight, target, vocab_start_index, chunk_size, temperature, return_entropy,
        tp_group, logprob_gradient,
    )  # fmt: skip
    return FusedLinearLogprobsOutput(logprobs, entropy if return_entropy else None)


def _reject_filtering(sampling_params: TrainingSamplingParams | None) -> float:
    """The temperature to use; raises `ValueError` if top-k/top-p is requested (not fusable)."""
    if sampling_params is None:
        return 1.0
    if sampling_params.filters:
        raise ValueError(
            f"fused linear logprobs do not support top-k/top-p filtering (top_k="
            f"{sampling_params.top_k}, top_p={sampling_params.top_p}): filtering needs whole vocab "
            f"rows. Compute logits and use from_parallel_logits_to_logprobs instead."
        )
    return sampling_params.temperature


@overload
def from_hidden_to_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
    vocab_end_index: int, tp_group: Any, cp_group: Any = ..., chunk_size: int | None = ...,
    sampling_params: TrainingSamplingParams | None = ..., *, return_entropy: Literal[False] = ...,
    logprob_gradient: LogprobGradient | None = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def from_hidden_to_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
    vocab_end_index: int, tp_group: Any, cp_group: Any = ..., chunk_size: int | None = ...,
    sampling_params: TrainingSamplingParams | None = ..., *, return_entropy: Literal[True],
    logprob_gradient: None = ...,
) -> FusedLinearLogprobsOutput: ...  # fmt: skip
def from_hidden_to_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    cp_group: Any = None,
    chunk_size: int | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    *,
    return_entropy: bool = False,
    logprob_gradient: LogprobGradient | None = None,
) -> torch.Tensor | FusedLinearLogprobsOutput:
    """Dense next-token logprobs `[B, S-1]` fp32 from this CP rank's zigzag shard of the final
    hidden states `[B, S/CP, H]`, `weight [V/TP, H]` and unshifted `target [B, S]` (the fused
    counterpart of `from_parallel_logits_to_logprobs`); with `return_entropy` a
    `FusedLinearLogprobsOutput` of two `[B, S-1]`.

    Args:
        sampling_params: only `temperature` is used; top-k/top-p raise `ValueError`.
        logprob_gradient: `gradient(logprobs [B, S-1]) -> dL/dlogprobs [B, S-1]`, CP = 1 only.
    """
    temperature = _reject_filtering(sampling_params)
    _, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    _check_forward_gradient_cp(logprob_gradient, cp_size)
    check_ndim(hidden, 3, "hidden", "[B, S/CP, H]")
    tp_size = _check_fused_args(
        hidden, weight, vocab_start_index, vocab_end_index, tp_group, chunk_size, temperature
    )
    batch, local_seq, width = hidden.shape
    check_dense_layout(local_seq, batch, target, cp_size, weight.shape[0] * tp_size)
    entropy: list[torch.Tensor] = []
    flat_gradient = None
    if logprob_gradient is not None:
        flat_gradient = _row_gradient(
            logprob_gradient,
            lambda lp: run_dense(lambda _: lp.view(batch, local_seq), target, local_seq, None),
        )

    def kernel(local_target: torch.Tensor) -> torch.Tensor:
        flat = fused_linear_logprobs(
            hidden.reshape(-1, width), weight, local_target.reshape(-1), vocab_start_index,
            vocab_end_index, tp_group, chunk_size, temperature, return_entropy, flat_gradient,
        )  # fmt: skip
        if flat.entropy is not None:
            entropy.append(flat.entropy.view(batch, local_seq))
        return flat.logprobs.view(batch, local_seq)

    logprobs = run_dense(kernel, target, local_seq, cp_group)
    if not return_entropy:
        return logprobs
    # the same CP gather and trim as the logprobs (the entropy does not depend on the target)
    return FusedLinearLogprobsOutput(
        logprobs, run_dense(lambda _: entropy[0], target, local_seq, cp_group)
    )


def _check_forward_gradient_cp(logprob_gradient: LogprobGradient | None, cp_size: int) -> None:
    # the loss reads logprobs gathered over CP, so a per-chunk prediction of its gradient needs CP =
    # 1
    if logprob_gradient is not None and cp_size > 1:
        raise ValueError(
            f"`logprob_gradient` (gradient in the forward) needs CP = 1, got a cp_group of size "
            f"{cp_size}: the loss reads logprobs gathered over CP"
        )


def _row_gradient(
    gradient: LogprobGradient, to_rows: Callable[[torch.Tensor], torch.Tensor]
) -> LogprobGradient:
    """`gradient` over the `[B, S-1]` rows as the kernel's `[T]` one, through the linear map
    `to_rows` (`run_dense` / `run_packed` at CP = 1) and its adjoint (0 for tokens no row reads)."""

    def flat(logprobs: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            # to_rows is linear: autograd's adjoint of it carries the rows' gradient back to the
            # kernel's tokens
            leaf = logprobs.detach().requires_grad_()
            rows = to_rows(leaf)
            (grad,) = torch.autograd.grad(rows, leaf, grad_outputs=gradient(rows.detach()))
        return grad

    return flat


@overload
def from_hidden_to_logprobs_packed_sequences(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int], unpacked_seqlen: int,
    vocab_start_index: int, vocab_end_index: int, tp_group: Any, cp_group: Any = ...,
    chunk_size: int | None = ..., sampling_params: TrainingSamplingParams | None = ...,
    target_is_pre_rolled: bool = ..., *, return_entropy: Literal[False] = ...,
    logprob_gradient: LogprobGradient | None = ...,
) -> torch.Tensor: ...  # fmt: skip
@overload
def from_hidden_to_logprobs_packed_sequences(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int], unpacked_seqlen: int,
    vocab_start_index: int, vocab_end_index: int, tp_group: Any, cp_group: Any = ...,
    chunk_size: int | None = ..., sampling_params: TrainingSamplingParams | None = ...,
    target_is_pre_rolled: bool = ..., *, return_entropy: Literal[True],
    logprob_gradient: None = ...,
) -> FusedLinearLogprobsOutput: ...  # fmt: skip
def from_hidden_to_logprobs_packed_sequences(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    cp_group: Any = None,
    chunk_size: int | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    target_is_pre_rolled: bool = False,
    *,
    return_entropy: bool = False,
    logprob_gradient: LogprobGradient | None = None,
) -> torch.Tensor | FusedLinearLogprobsOutput:
    """Packed (THD) next-token logprobs `[B, S-1]` fp32 from this rank's packed hidden states
    `[1, T/CP, H]` (per-sequence zigzag), `weight [V/TP, H]` and `target` (`[1, T]` full, or
    `[1, T/CP]` pre-rolled and sharded); with `return_entropy` a `FusedLinearLogprobsOutput` of two
    `[B, S-1]`.

    Args:
        cu_seqlens_padded: `[B+1]` padded span boundaries.
        unpacked_seqlen: `S` of the unpacked batch.
        sampling_params: only `temperature` is used; top-k/top-p raise `ValueError`.
        logprob_gradient: as in `from_hidden_to_logprobs` (CP = 1).
    """
    temperature = _reject_filtering(sampling_params)
    _, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    _check_forward_gradient_cp(logprob_gradient, cp_size)
    check_ndim(hidden, 3, "hidden", "[1, T/CP, H]")
    if hidden.shape[0] != 1:
        raise ValueError(f"packed `hidden` must have batch dim 1, got {tuple(hidden.shape)}")
    tp_size = _check_fused_args(
        hidden, weight, vocab_start_index, vocab_end_index, tp_group, chunk_size, temperature
    )
    local_len = hidden.shape[1]
    cu = normalise_cu_seqlens(cu_seqlens_padded, local_len, cp_size)
    check_packed_target(target, local_len, cp_size, cu, target_is_pre_rolled)
    check_token_ids(target, weight.shape[0] * tp_size, "target")
    entropy: list[torch.Tensor] = []
    flat_gradient = None
    if logprob_gradient is not None:
        flat_gradient = _row_gradient(
            logprob_gradient,
            lambda lp: run_packed(
                lambda _: lp.unsqueeze(0),
                target,
                cu,
                local_len,
                unpacked_seqlen,
                None,
                target_is_pre_rolled,
            ),  # fmt: skip
        )

    def kernel(local_target: torch.Tensor) -> torch.Tensor:
        flat = fused_linear_logprobs(
            hidden[0], weight, local_target[0], vocab_start_index, vocab_end_index, tp_group,
            chunk_size, temperature, return_entropy, flat_gradient,
        )  # fmt: skip
        if flat.entropy is not None:
            entropy.append(flat.entropy.unsqueeze(0))
        return flat.logprobs.unsqueeze(0)

    logprobs = run_packed(
        kernel, target, cu, local_len, unpacked_seqlen, cp_group, target_is_pre_rolled
    )
    if not return_entropy:
        return logprobs
    # the same per-sequence CP gather and unpacking as the logprobs
    rows = run_packed(
        lambda _: entropy[0], target, cu, local_len, unpacked_seqlen, cp_group,
        target_is_pre_rolled,
    )  # fmt: skip
    return FusedLinearLogprobsOutput(logprobs, rows)
