"""Next-token logprobs `[B, S-1]` from TP/CP-sharded logits, dense `[B, S]` and packed (THD)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_mcore_rl.ops._checks import (
    check_chunk_size,
    check_ndim,
    check_token_ids,
    check_vocab_shard,
    group_rank_size,
)
from lightning_mcore_rl.ops.context_parallel import (
    allgather_cp_sharded_tensor,
    get_tokens_on_this_cp_rank,
)
from lightning_mcore_rl.ops.sampling import (
    TrainingSamplingParams,
    distributed_logprob_with_sampling,
)
from lightning_mcore_rl.ops.vocab_parallel import distributed_logprob

# ``local_target [B, S_l] -> logprobs [B, S_l]`` for this rank's shard
TokenKernel = Callable[[torch.Tensor], torch.Tensor]


def dense_local_targets(
    target: torch.Tensor, local_seq_len: int, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """`roll(target [B, S], -1)` right-padded with 0 to `S_l * CP`, this rank's zigzag shard
    `[B, S_l]` (`local_seq_len` = `S_l`, `S_l * CP >= S`)."""
    # order (docs/behaviour-reference.md §5.5/§5.6, trap 1): roll by -1, right-pad to S_l * CP,
    # zigzag-shard, run the kernel, all-gather over CP, drop the padding, then the last position (it
    # scored the wrapped-around first token)
    rolled = target.roll(-1, dims=1)
    padded = F.pad(rolled, (0, local_seq_len * cp_size - target.shape[1]))
    return get_tokens_on_this_cp_rank(padded, cp_rank, cp_size, seq_dim=1)


def packed_local_targets(
    target: torch.Tensor,
    cu_seqlens_padded: Sequence[int],
    local_len: int,
    cp_rank: int,
    cp_size: int,
) -> torch.Tensor:
    """Each packed sequence of `target [1, T]` rolled inside its padded span (`cu_seqlens_padded`,
    `B+1`), then CP-sharded per sequence: `[1, T/CP]`, sequence `i` at `[start_i/CP : end_i/CP]`."""
    out = target.new_zeros(1, local_len)
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True):
        if end > start:
            span = target[:, start:end].roll(-1, dims=1)  # never crosses into the next sequence
            shard = get_tokens_on_this_cp_rank(span, cp_rank, cp_size, seq_dim=1)
            out[:, start // cp_size : end // cp_size] = shard
    return out


def _token_kernel(
    logits: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    inference_only: bool,
    chunk_size: int | None,
    sampling_params: TrainingSamplingParams | None,
) -> TokenKernel:
    # top-k/top-p needs whole vocab rows (an all-to-all per chunk); without filtering the
    # vocab-parallel kernel needs only [..., 1] all-reduces
    if sampling_params is not None and sampling_params.filters:
        return lambda local_target: distributed_logprob_with_sampling(
            logits, local_target, vocab_start_index, vocab_end_index, tp_group,
            sampling_params, inference_only, chunk_size,
        )  # fmt: skip
    return lambda local_target: distributed_logprob(
        logits, local_target, vocab_start_index, vocab_end_index, tp_group,
        inference_only, chunk_size,
    )  # fmt: skip


def check_dense_layout(
    local_seq_len: int, batch: int, target: torch.Tensor, cp_size: int, global_vocab: int
) -> None:
    """Validate dense targets `[B, S]` against a local shard of `[B, S_l]` tokens."""
    check_ndim(target, 2, "target", "[B, S]")
    if target.shape[0] != batch or target.shape[1] > local_seq_len * cp_size:
        raise ValueError(
            f"`target` [B, S] = {tuple(target.shape)} must have B = {batch} and S <= S_local * CP "
            f"= {local_seq_len} * {cp_size} = {local_seq_len * cp_size}"
        )
    # a zigzag shard is two equal chunks
    if cp_size > 1 and local_seq_len % 2 != 0:
        raise ValueError(
            f"the padded sequence S_local * CP = {local_seq_len * cp_size} must be divisible by "
            f"2*CP = {2 * cp_size} (S_local = {local_seq_len} must be even)"
        )
    check_token_ids(target, global_vocab, "target")


def run_dense(
    kernel: TokenKernel, target: torch.Tensor, local_seq_len: int, cp_group: Any
) -> torch.Tensor:
    """Shard dense targets, run `kernel`, gather over CP, unpad, drop the last column."""
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    local = kernel(dense_local_targets(target, local_seq_len, cp_rank, cp_size))
    if cp_size > 1:
        local = allgather_cp_sharded_tensor(local, cp_group, seq_dim=1)
    # the last position scored the wrapped-around first token
    return local[:, : target.shape[1] - 1]


def from_parallel_logits_to_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    inference_only: bool = False,
    cp_group: Any = None,
    chunk_size: int | None = None,
    sampling_params: TrainingSamplingParams | None = None,
) -> torch.Tensor:
    """Next-token logprobs `[B, S-1]` fp32 (entry `t` is `log p(target[t+1] | target[<=t])`) of
    unshifted `target [B, S]` from this rank's CP and vocab shard `logits [B, S/CP, V/TP]`
    (temperature already applied; any float dtype).

    Args:
        chunk_size: tokens per chunk for the chunked kernels (`None`: unchunked).
        sampling_params: top-k/top-p filtering when active (temperature is not applied here).
    """
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    check_ndim(logits, 3, "logits", "[B, S/CP, V_l]")
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, tp_group)
    check_chunk_size(chunk_size)
    batch, local_seq_len, local_vocab = logits.shape
    check_dense_layout(local_seq_len, batch, target, cp_size, local_vocab * tp_size)
    kernel = _token_kernel(
        logits, vocab_start_index, vocab_end_index, tp_group, inference_only, chunk_size,
        sampling_params,
    )  # fmt: skip
    return run_dense(kernel, target, local_seq_len, cp_group)


def normalise_cu_seqlens(
    cu_seqlens_padded: torch.Tensor | Sequence[int], local_len: int, cp_size: int
) -> list[int]:
    """`cu_seqlens_padded` as a checked list of ints (one host sync if a tensor)."""
    cu = [
        int(v)
        for v in (
            # the spans are walked on the host below: one sync here, none per span
            cu_seqlens_padded.tolist() if torch.is_tensor(cu_seqlens_padded) else cu_seqlens_padded
        )
    ]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(
            f"`cu_seqlens_padded` must be non-decreasing, start at 0 and have B+1 >= 2 entries, "
            f"got {cu}"
        )
    if cu[-1] > local_len * cp_size:
        raise ValueError(
            f"`cu_seqlens_padded[-1]` = {cu[-1]} exceeds the packed length T = T_local * CP = "
            f"{local_len} * {cp_size}"
        )
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        # each span is zigzag-sharded on its own, so each must split into 2*CP equal chunks
        if cp_size > 1 and (b - a) % (2 * cp_size) != 0:
            raise ValueError(
                f"packed sequence {i} has padded length {b - a}, not divisible by 2*CP = "
                f"{2 * cp_size}; pad each sequence to a multiple of 2*CP"
            )
    return cu


def check_packed_target(
    target: torch.Tensor, local_len: int, cp_size: int, cu: list[int], pre_rolled: bool
) -> None:
    """Validate packed targets: `[1, T/CP]` pre-rolled, else the full `[1, T]`."""
    if pre_rolled:
        if tuple(target.shape) != (1, local_len):
            raise ValueError(
                f"pre-rolled `target` must be this rank's [1, T/CP] = [1, {local_len}], got "
                f"{tuple(target.shape)}"
            )
    elif target.dim() != 2 or target.shape[0] != 1 or target.shape[1] < cu[-1]:
        raise ValueError(
            f"`target` must be the full packed [1, T] with T >= cu_seqlens_padded[-1] = {cu[-1]}, "
            f"got {tuple(target.shape)}"
        )


def run_packed(
    kernel: TokenKernel,
    target: torch.Tensor,
    cu: list[int],
    local_len: int,
    unpacked_seqlen: int,
    cp_group: Any,
    target_is_pre_rolled: bool,
) -> torch.Tensor:
    """Roll/shard packed targets, run `kernel`, gather per sequence over CP, unpack."""
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    if not target_is_pre_rolled:
        target = packed_local_targets(target, cu, local_len, cp_rank, cp_size)
    probs = kernel(target).squeeze(0)  # [T/CP]
    width = unpacked_seqlen - 1
    rows = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        n = max(0, min(end - start - 1, width))
        if n == 0:
            rows.append(probs.new_zeros(width))
            continue
        span = probs[start // cp_size : end // cp_size]
        if cp_size > 1:
            # per sequence, never the whole buffer (docs/behaviour-reference.md trap 3)
            span = allgather_cp_sharded_tensor(span, cp_group, seq_dim=0)
        rows.append(F.pad(span[:n], (0, width - n)))
    return torch.stack(rows)


def from_parallel_logits_to_logprobs_packed_sequences(
    logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: Any,
    inference_only: bool = False,
    cp_group: Any = None,
    chunk_size: int | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    target_is_pre_rolled: bool = False,
) -> torch.Tensor:
    """Next-token logprobs `[B, S-1]` fp32 of packed (THD) sequences from this rank's packed CP
    shard (per-sequence zigzag) and vocab shard `logits [1, T/CP, V/TP]`: row `i` holds
    `min(len_i - 1, S - 1)` logprobs, zeros after.

    Args:
        target: `[1, T]` unshifted ids, or `[1, T/CP]` rolled and sharded if `target_is_pre_rolled`.
        cu_seqlens_padded: `[B+1]` padded span boundaries (each span a multiple of 2*CP).
        unpacked_seqlen: `S` of the unpacked batch.
        group: tensor-parallel group.
    """
    cp_rank, cp_size = group_rank_size(cp_group, "cp_group", allow_none=True)
    check_ndim(logits, 3, "logits", "[1, T/CP, V_l]")
    if logits.shape[0] != 1:
        raise ValueError(f"packed `logits` must have batch dim 1, got {tuple(logits.shape)}")
    _, tp_size = check_vocab_shard(logits, vocab_start_index, vocab_end_index, group)
    check_chunk_size(chunk_size)
    local_len = logits.shape[1]
    cu = normalise_cu_seqlens(cu_seqlens_padded, local_len, cp_size)
    check_packed_target(target, local_len, cp_size, cu, target_is_pre_rolled)
    check_token_ids(target, logits.shape[-1] * tp_size, "target")
    kernel = _token_kernel(
        logits, vocab_start_index, vocab_end_index, group, inference_only, chunk_size,
        sampling_params,
    )  # fmt: skip
    return run_packed(
        kernel, target, cu, local_len, unpacked_seqlen, cp_group, target_is_pre_rolled
    )
