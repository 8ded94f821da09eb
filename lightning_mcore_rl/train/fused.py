"""The fused LM head: logprobs from the last stage's hidden states, never building logits."""

# With `use_fused_linear_logprobs` the last stage returns its final hidden states `[B, S, H]` and
# the post-processors compute token logprobs from `hidden x W_out^T / T` with the chunked kernels
# of `ops.fused_linear`, never building `[tokens, V_l]` logits.
# Shapes: `B` sequences, `S` width, `T` packed tokens, `H` hidden size, `V_l = V/TP`.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import LossFunction
from lightning_mcore_rl.losses.loss_input import _pack_input_ids
from lightning_mcore_rl.losses.loss_input._common import _group_rank, _group_size, _needs_entropy
from lightning_mcore_rl.ops import (
    FusedLinearLogprobsOutput,
    LogprobGradient,
    TrainingSamplingParams,
    from_hidden_to_logprobs,
    from_hidden_to_logprobs_packed_sequences,
)
from lightning_mcore_rl.parallel import shard_range, unwrap_model

FUSED_NEEDS_LOGITS = (
    "{what} needs the [tokens, V/TP] logits, which the fused linear logprobs path never builds; "
    "use `MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=False))`"
)
"""Error text for options the fused path cannot serve (format with ``what=``)."""


def reject_filtering(sampling_params: TrainingSamplingParams | None, owner: str) -> None:
    """Top-k/top-p need whole vocab rows of logits: ``ValueError`` naming ``owner`` if set."""
    if sampling_params is not None and sampling_params.filters:
        raise ValueError(
            FUSED_NEEDS_LOGITS.format(
                what=f"top-k/top-p filtering in {owner} (top_k={sampling_params.top_k}, "
                f"top_p={sampling_params.top_p})"
            )
        )


def output_weight(model: torch.nn.Module) -> Tensor:
    """The `[V_l, H]` weight a `GPTModel` last stage multiplies its hidden states with."""
    inner = cast(Any, unwrap_model(model))  # a GPTModel, checked by check_fused_chunks
    # Tied: the word embedding when this chunk also embeds, else the last stage's own copy,
    # which megatron keeps equal to the embedding by all-reducing their gradients; the same
    # pick as `GPTModel._postprocess`. Untied: `output_layer.weight`.
    if inner.share_embeddings_and_output_weights:
        return cast(Tensor, inner.shared_embedding_or_output_weight())
    return cast(Tensor, inner.output_layer.weight)


def check_fused_chunks(chunks: Sequence[torch.nn.Module]) -> None:
    """Every chunk is a `GPTModel` without multi-token prediction (the same on every rank).

    Raises:
        TypeError: a chunk is not a megatron `GPTModel`.
        ValueError: `mtp_num_layers` is set (its extra heads need logits).
    """
    from megatron.core.models.gpt import GPTModel

    for i, chunk in enumerate(chunks):
        inner = unwrap_model(chunk)
        if not isinstance(inner, GPTModel):
            raise TypeError(
                f"use_fused_linear_logprobs needs megatron GPTModel chunks (their output layer is "
                f"bypassed), got chunk {i} of type {type(inner).__name__}; use "
                "`MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=False))`"
            )
        if inner.config.mtp_num_layers:
            raise ValueError(
                FUSED_NEEDS_LOGITS.format(
                    what=f"multi-token prediction (mtp_num_layers={inner.config.mtp_num_layers})"
                )
            )


@contextlib.contextmanager
def _output_layer_forward(model: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """For the block, `model`'s output layer runs `forward` (its module hooks still run).

    Raises:
        RuntimeError: the output layer is already bypassed (nested use).
    """
    # an instance attribute, removed on exit, also on error
    # megatron-core 0.16's GPTModel has no hook between its final norm and its output layer:
    # this is the one bridge (this module object only, never the class or a global); the layer
    # stays the same module, so its hooks (DDP's parameter-gather pre-hook, captures) still run.
    # megatron-core >= 0.18's `output_processor` hook would replace this, nothing else
    layer = cast(Any, unwrap_model(model)).output_layer
    if "forward" in vars(layer):
        raise RuntimeError("the output layer of this chunk is already bypassed (nested use)")
    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def lm_head_returns_hidden(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """For the block, the output layer of `model` (a `GPTModel` last stage) returns its input:
    the chunk outputs `[B, S, H]`.

    Raises:
        RuntimeError: already bypassed (nested use), or called with another weight.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    layer = cast(Any, unwrap_model(model)).output_layer
    expected = output_weight(model)

    def passthrough(
        input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[Tensor, None]:
        used = layer.weight if weight is None else weight
        if used is not expected:
            raise RuntimeError(
                "GPTModel called its output layer with another weight than the fused path's "
                "output_weight(model); the megatron-core version is not supported"
            )
        # [S/TP, B, H] -> [S, B, H]; backward: the local slice, since the fused kernel's
        # backward all-reduces the input gradient over TP already
        if layer.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=False, group=layer.tp_group
            )
        return input_, None

    return _output_layer_forward(model, passthrough)


def batch_first_applies(model: torch.nn.Module) -> bool:
    """Whether `lm_head_batch_first` can serve `model`."""
    # A last stage whose output layer is megatron's `ColumnParallelLinear` (not a replaced head,
    # e.g. the reward model's scalar head), without sequence parallelism (the layer gathers its
    # input along dim 0, the sequence) and without multi-token prediction (its loss reads the
    # head's `[S, B, V_l]` output inside `GPTModel`).
    from megatron.core.tensor_parallel import ColumnParallelLinear

    inner = cast(Any, unwrap_model(model))
    layer = getattr(inner, "output_layer", None)
    if not isinstance(layer, ColumnParallelLinear) or not getattr(inner, "post_process", False):
        return False
    return not layer.sequence_parallel and not inner.config.mtp_num_layers


def lm_head_batch_first(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """For the block, the plain LM head of `model` (a wrapped `GPTModel` last stage, where
    `batch_first_applies`) computes its logits `[B, S, V_l]` batch-first."""
    # GPTModel returns logits.transpose(0, 1).contiguous(): a second [B, S, V_l] copy in the
    # forward (and of the gradient in the backward). The layer's own forward (same weights, TP
    # communication, gradient accumulation) on a [B, S, H] copy returns the logits as their
    # [S, B, V_l] transpose, which GPTModel's transpose turns back without a copy. Every logit
    # is the same dot product (bitwise equal); the weight gradient sums the tokens in another
    # order (fp32 rounding)
    layer = cast(Any, unwrap_model(model)).output_layer
    forward = type(layer).forward

    def batch_first(
        input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[Tensor, Any]:
        # [S, B, H] -> [B, S, H] (megatron's weight-gradient GEMM views its input flat)
        hidden = input_.transpose(0, 1).contiguous()
        logits, bias = forward(
            layer, hidden, weight=weight, runtime_gather_output=runtime_gather_output
        )
        return logits.transpose(0, 1), bias  # [B, S, V_l] as [S, B, V_l]

    return _output_layer_forward(model, batch_first)


@dataclass(frozen=True)
class FusedLMHead:
    """What the post-processors need to finish the LM head of one microbatch."""

    weight: Tensor  # `[V_l, H]` this TP rank's output weight (`output_weight`)
    # only its temperature is used (top-k/top-p are rejected before the pass), dividing
    # `hidden x W^T` exactly once
    sampling_params: TrainingSamplingParams | None

    def vocab_range(self, tp_rank: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's vocabulary shard."""
        return shard_range(self.weight.shape[0], tp_rank)

    def as_input(self, hidden: Tensor) -> Tensor:
        """``hidden`` in the weight's dtype (``Float16Module`` upcasts the last stage's output to
        fp32; the bf16 values are exact, so casting back loses nothing)."""
        return hidden.to(self.weight.dtype)

    def dense(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        tp_rank: int,
        tp_group: Any,
        cp_group: Any,
        chunk_size: int | None,
        with_entropy: bool,
        logprob_gradient: LogprobGradient | None = None,
    ) -> FusedLinearLogprobsOutput:
        """Next-token logprobs (and the positive entropy) `[B, S-1]` of dense rows from
        `hidden [B, S/CP, H]` and the unshifted `input_ids [B, S]`."""
        # `chunk_size` `None`: 64 MiB of fp32 logits per chunk; `logprob_gradient`: the loss's
        # gradient w.r.t. the `[B, S-1]` logprobs for the gradient in the forward (CP = 1)
        args = (
            self.as_input(hidden), self.weight, input_ids, *self.vocab_range(tp_rank), tp_group,
            cp_group, chunk_size, self.sampling_params,
        )  # fmt: skip
        if with_entropy:
            return from_hidden_to_logprobs(*args, return_entropy=True)
        lp = from_hidden_to_logprobs(*args, logprob_gradient=logprob_gradient)
        return FusedLinearLogprobsOutput(lp, None)

    def packed(
        self,
        hidden: Tensor,
        target: Tensor,
        cu_seqlens_padded: Sequence[int],
        width: int,
        tp_rank: int,
        tp_group: Any,
        cp_group: Any,
        chunk_size: int | None,
        with_entropy: bool,
        target_is_pre_rolled: bool,
        logprob_gradient: LogprobGradient | None = None,
    ) -> FusedLinearLogprobsOutput:
        """Next-token logprobs (and the positive entropy) `[B, S-1]` of one packed THD row from
        `hidden [1, T/CP, H]` and `target` (`[1, T]`, or `[1, T/CP]` with `target_is_pre_rolled`)."""
        args = (
            self.as_input(hidden), self.weight, target, cu_seqlens_padded, width,
            *self.vocab_range(tp_rank), tp_group, cp_group, chunk_size, self.sampling_params,
        )  # fmt: skip
        if with_entropy:
            return from_hidden_to_logprobs_packed_sequences(
                *args, target_is_pre_rolled=target_is_pre_rolled, return_entropy=True
            )
        lp = from_hidden_to_logprobs_packed_sequences(
            *args, target_is_pre_rolled=target_is_pre_rolled, logprob_gradient=logprob_gradient
        )
        return FusedLinearLogprobsOutput(lp, None)


def _loss_input(out: FusedLinearLogprobsOutput) -> dict[str, Any]:
    loss_input: dict[str, Any] = {"next_token_logprobs": out.logprobs}
    if out.entropy is not None:
        loss_input["entropy"] = out.entropy
    return loss_input


PrepareFn = Callable[..., tuple[dict[str, Any], BatchedDataDict]]

ValidCounts = tuple[Any, Any]
"""``(global_valid_seqs, global_valid_toks)`` of the pass: what the loss is called with."""


def gradient_in_forward_applies(loss_fn: LossFunction, cp_size: int) -> bool:
    """Whether the fused head computes its gradients in the forward for `loss_fn`."""
    # the loss declares `token_local_gradient`, needs no entropy (whose gradient is not
    # predicted) and CP = 1 (the loss reads logprobs gathered over CP)
    local = bool(getattr(loss_fn, "token_local_gradient", False))
    return local and not _needs_entropy(loss_fn) and cp_size == 1


def _logprob_gradient(
    hidden: Tensor,
    data: BatchedDataDict,
    loss_fn: LossFunction,
    cp_group: Any,
    valid_counts: ValidCounts | None,
) -> LogprobGradient | None:
    """The predictor of `loss_fn`'s gradient w.r.t. the `[B, S-1]` logprobs, or `None`."""
    # `loss_fn`'s own autograd on the logprobs made so far (the kernel calls it after each
    # chunk); `None` where the gradient in the forward does not apply (no `valid_counts`) or no
    # backward follows (a forward-only pass)
    if valid_counts is None or not (torch.is_grad_enabled() and hidden.requires_grad):
        return None
    if not gradient_in_forward_applies(loss_fn, _group_size(cp_group)):
        return None
    global_valid_seqs, global_valid_toks = valid_counts

    def gradient(logprobs: Tensor) -> Tensor:  # [B, S-1] -> dL/dlogprobs [B, S-1]
        with torch.enable_grad():
            leaf = logprobs.detach().requires_grad_()
            loss, _ = loss_fn(data, global_valid_seqs, global_valid_toks, next_token_logprobs=leaf)
            if not loss.requires_grad:  # the loss does not read the logprobs
                return torch.zeros_like(leaf)
            (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        return torch.zeros_like(leaf) if grad is None else grad

    return gradient


def fused_prepare_fn(
    head: FusedLMHead, chunk_size: int | None, valid_counts: ValidCounts | None = None
) -> PrepareFn:
    """`prepare_fn(hidden, data, loss_fn, tp_rank, tp_group, cp_group)` of a `LOGPROB` loss on
    dense rows (`hidden [B, S/CP, H]`): the fused `losses.prepare_loss_input`."""
    # packed rows take `fused_packed_prepare_fn`; with `valid_counts` (training) the head
    # computes its gradients in the forward where `gradient_in_forward_applies`
    # only where the prepared call is the microbatch's one kernel call: each call holds an fp32
    # [V_l, H] gradient until its backward

    def prepare(
        hidden: Tensor, data: BatchedDataDict, loss_fn: LossFunction, tp_rank: int | None,
        tp_group: Any, cp_group: Any,
    ) -> tuple[dict[str, Any], BatchedDataDict]:  # fmt: skip
        rank = _group_rank(tp_group) if tp_rank is None else tp_rank
        ids = cast(Tensor, data["input_ids"])  # [B, S] by the BatchedDataDict contract
        gradient = _logprob_gradient(hidden, data, loss_fn, cp_group, valid_counts)
        out = head.dense(
            hidden, ids, rank, tp_group, cp_group, chunk_size, _needs_entropy(loss_fn),
            logprob_gradient=gradient,
        )  # fmt: skip
        return _loss_input(out), data

    return prepare


def fused_packed_prepare_fn(
    head: FusedLMHead, chunk_size: int | None, valid_counts: ValidCounts | None = None
) -> PrepareFn:
    """`prepare_fn(hidden, data, loss_fn, cu_q, cu_qp, tp_rank, tp_group, cp_group)` of the
    one-pass packed wrapper (`hidden [1, T/CP, H]`): the fused `prepare_packed_loss_input`."""

    def prepare(
        hidden: Tensor, data: BatchedDataDict, loss_fn: LossFunction,
        cu_seqlens_q: Tensor | Sequence[int], cu_seqlens_q_padded: Tensor | Sequence[int],
        tp_rank: int | None, tp_group: Any, cp_group: Any,
    ) -> tuple[dict[str, Any], BatchedDataDict]:  # fmt: skip
        rank = _group_rank(tp_group) if tp_rank is None else tp_rank
        cp_rank, cp_size = _group_rank(cp_group), _group_size(cp_group)
        ids = cast(Tensor, data["input_ids"])  # [B, S] by the BatchedDataDict contract
        cu_qp = [int(v) for v in cu_seqlens_q_padded]
        targets = _pack_input_ids(ids, cu_seqlens_q, cu_qp, cp_rank, cp_size, roll_shift=-1)
        gradient = _logprob_gradient(hidden, data, loss_fn, cp_group, valid_counts)
        out = head.packed(
            hidden, targets, cu_qp, ids.shape[1], rank, tp_group, cp_group, chunk_size,
            _needs_entropy(loss_fn), target_is_pre_rolled=True, logprob_gradient=gradient,
        )  # fmt: skip
        return _loss_input(out), data

    return prepare
