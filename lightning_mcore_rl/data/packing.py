"""THD sequence packing for megatron-core (docs/behaviour-reference.md §6.1, §6.2): `B` right-padded
rows `[B, S]` become one packed row `[1, T]`, sequence `i` in the span
`[cu_seqlens_padded[i], cu_seqlens_padded[i+1])` (its real tokens, then zeros); a CP rank holds
`[1, T/CP]`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, get_args

import torch

from lightning_mcore_rl.ops import get_tokens_on_this_cp_rank, restore_from_cp_shards

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

Fp8Recipe = Literal["tensorwise", "delayed", "blockwise", "mxfp8"]
MoeTokenDispatcherType = Literal["allgather", "alltoall", "flex"]
"""megatron's ``TransformerConfig.moe_token_dispatcher_type`` values."""
MoeFlexDispatcherBackend = Literal["deepep", "hybridep"]
"""megatron's ``TransformerConfig.moe_flex_dispatcher_backend`` values."""

# Packed-total multiple each FP8 recipe's GEMM kernels need
# (docs/behaviour-reference.md §6.1, NeMo RL PR #1569).
_FP8_DIVISOR: dict[str, int] = {"tensorwise": 16, "delayed": 16, "blockwise": 128, "mxfp8": 32}
# HybridEP's deep_ep JIT kernels need MAX_NUM_OF_TOKENS_PER_RANK divisible by their
# NUM_OF_TOKENS_PER_CHUNK = 128 (docs/behaviour-reference.md §6.1, NeMo RL PR #4079).
_HYBRIDEP_DIVISOR = 128


class PackedSequences(NamedTuple):
    """Result of `pack_sequences`; unpacks as the reference packer's 5-tuple
    (docs/behaviour-reference.md §6.2)."""

    packed_full: torch.Tensor
    """``[1, T]`` all spans, unsharded."""
    packed_local: torch.Tensor
    """``[1, T/CP]`` this CP rank's zigzag shard of every span, concatenated."""
    packed_seq_params: PackedSeqParams
    """megatron ``PackedSeqParams`` with ``qkv_format="thd"`` and padded boundaries."""
    cu_seqlens: torch.Tensor
    """``[B+1]`` int32 prefix sums of the real lengths."""
    cu_seqlens_padded: torch.Tensor
    """``[B+1]`` int32 span boundaries in the packed row (last entry ``T``)."""


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is `>= value`."""
    return -(-value // multiple) * multiple


def minimum_pad_individual(
    *, tensor_model_parallel_size: int, sequence_parallel: bool, context_parallel_size: int
) -> int:
    """Smallest per-sequence pad factor the parallel layout needs: `(2*CP if CP>1) * (TP if SP)`."""
    # CP splits each sequence into 2*CP zigzag chunks; sequence parallelism splits the tokens over
    # TP as well
    cp_factor = 2 * context_parallel_size if context_parallel_size > 1 else 1
    tp_factor = (
        tensor_model_parallel_size if tensor_model_parallel_size > 1 and sequence_parallel else 1
    )
    return cp_factor * tp_factor


def get_pack_sequence_parameters(
    *,
    tensor_model_parallel_size: int,
    sequence_parallel: bool,
    pipeline_model_parallel_size: int,
    context_parallel_size: int,
    pad_individual: int,
    max_seq_len_in_batch: int,
    fp8: Fp8Recipe | None = None,
    moe_token_dispatcher_type: MoeTokenDispatcherType = "allgather",
    moe_flex_dispatcher_backend: MoeFlexDispatcherBackend = "deepep",
) -> tuple[int, int, int | None]:
    """`(pad_individual, pad_packed_multiple, pad_packed_to)` for `pack_sequences` under a parallel
    layout (docs/behaviour-reference.md §6.1); `fp8` and the MoE dispatcher fields as megatron's
    config names them.

    Raises:
        ValueError: a size < 1, an unknown `fp8` recipe or MoE dispatcher option, or a
            `pad_individual` that is not a multiple of `minimum_pad_individual`.
    """
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "pad_individual": pad_individual,
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    if fp8 is not None and fp8 not in _FP8_DIVISOR:
        raise ValueError(f"`fp8` must be None or one of {sorted(_FP8_DIVISOR)}, got {fp8!r}")
    for name, option, allowed in (
        ("moe_token_dispatcher_type", moe_token_dispatcher_type, MoeTokenDispatcherType),
        ("moe_flex_dispatcher_backend", moe_flex_dispatcher_backend, MoeFlexDispatcherBackend),
    ):
        if option not in get_args(allowed):
            raise ValueError(f"`{name}` must be one of {list(get_args(allowed))}, got {option!r}")
    minimum = minimum_pad_individual(
        tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel_size,
    )
    if pad_individual % minimum != 0:
        raise ValueError(
            f"`pad_individual`={pad_individual} must be a multiple of {minimum}: context "
            f"parallelism needs 2*CP={2 * context_parallel_size} tokens per sequence chunk pair, and "
            f"sequence parallelism additionally multiplies by TP={tensor_model_parallel_size} "
            "(2*CP*TP with both); set make_sequence_length_divisible_by accordingly."
        )
    divisor = _FP8_DIVISOR[fp8] if fp8 is not None else 1
    if moe_token_dispatcher_type == "flex" and moe_flex_dispatcher_backend == "hybridep":
        divisor = max(divisor, _HYBRIDEP_DIVISOR)  # 128 is a multiple of every FP8 divisor
    # times the per-sequence minimum: the last span absorbs the bin padding and must stay divisible
    # by 2*CP (and TP under SP)
    pad_packed_multiple = divisor * minimum if divisor > 1 else 1
    # with PP > 1 every microbatch is padded to one length: the pipeline's send/recv shapes are
    # fixed
    pad_packed_to = (
        round_up(max_seq_len_in_batch, pad_packed_multiple)
        if pipeline_model_parallel_size > 1
        else None
    )
    return pad_individual, pad_packed_multiple, pad_packed_to


def padded_span_lengths(
    seq_lengths: list[int],
    pad_individual: int = 1,
    pad_packed_multiple: int = 1,
    pad_packed_to: int | None = None,
) -> list[int]:
    """`[B]` span lengths of `seq_lengths [B]` in the packed row, summing to `T`: each rounded up to
    `pad_individual`, the last absorbing the padding to `pad_packed_to` (exact) or a multiple of
    `pad_packed_multiple`.

    Raises:
        ValueError: `pad_packed_to` not a multiple of `pad_packed_multiple` or below the padded sum.
    """
    spans = [round_up(length, pad_individual) for length in seq_lengths]
    total = sum(spans)
    if pad_packed_to is not None:
        if pad_packed_to % pad_packed_multiple != 0:
            raise ValueError(
                f"`pad_packed_to`={pad_packed_to} must be a multiple of "
                f"`pad_packed_multiple`={pad_packed_multiple}"
            )
        if pad_packed_to < total:
            raise ValueError(
                f"`pad_packed_to`={pad_packed_to} is smaller than the packed length {total} "
                f"(sum of lengths rounded up to pad_individual={pad_individual}); raise "
                "max_seq_len_in_batch to the longest packed microbatch."
            )
        target = pad_packed_to
    else:
        target = round_up(total, pad_packed_multiple)
    # the last span absorbs all bin padding
    spans[-1] += target - total
    return spans


def pack_sequences(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual: int = 1,
    pad_packed_multiple: int = 1,
    pad_packed_to: int | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> PackedSequences:
    """Pack right-padded rows `input_ids [B, S]` of real lengths `seq_lengths [B]` (0 allowed) into
    one THD row:
    `PackedSequences(packed_full [1, T], packed_local [1, T/CP], packed_seq_params, cu_seqlens [B+1], cu_seqlens_padded [B+1])`
    (docs/behaviour-reference.md §6.2).

    Args:
        pad_individual: each sequence's span is rounded up to this multiple (of `2*CP` under CP).
        pad_packed_multiple: the packed total `T` is rounded up to this multiple.
        pad_packed_to: exact `T` (pipeline parallelism needs equal shapes).

    Raises:
        ValueError: bad shapes, lengths outside `[0, S]`, pad factors < 1, or spans that the CP
            zigzag layout cannot split.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = _check_pack_inputs(input_ids, seq_lengths, pad_individual, pad_packed_multiple)
    if cp_size > 1 and pad_individual % (2 * cp_size) != 0:
        raise ValueError(
            f"`pad_individual`={pad_individual} must be a multiple of 2*CP={2 * cp_size} so each "
            "sequence splits into 2*CP equal zigzag chunks; use get_pack_sequence_parameters."
        )
    needs_padding = pad_individual > 1 or pad_packed_multiple > 1 or pad_packed_to is not None
    spans = padded_span_lengths(lengths, pad_individual, pad_packed_multiple, pad_packed_to)
    if cp_size > 1 and spans[-1] % (2 * cp_size) != 0:
        raise ValueError(
            f"the last span ({spans[-1]} tokens after bin padding) is not a multiple of "
            f"2*CP={2 * cp_size}; `pad_packed_to`/`pad_packed_multiple` must be multiples of 2*CP."
        )
    device = input_ids.device
    cu_seqlens = _prefix_sums(lengths, device)
    cu_seqlens_padded = _prefix_sums(spans, device) if needs_padding else cu_seqlens.clone()
    max_seqlen = max(spans) if needs_padding else max(lengths)
    total = int(cu_seqlens_padded[-1])

    width = input_ids.shape[1]
    real = torch.arange(width, device=device)[None, :] < seq_lengths.to(device)[:, None]  # [B, S]
    # every real token scattered to its position in its span in one indexing op
    destination = cu_seqlens_padded[:-1, None].long() + torch.arange(width, device=device)[None, :]
    packed_full = input_ids.new_zeros(1, total)
    packed_full[0, destination[real]] = input_ids[real]
    # each span is zigzag-sharded on its own, never the whole row (docs/behaviour-reference.md trap
    # 3)
    local_index = cp_local_indices(cu_seqlens_padded, cp_rank, cp_size)
    packed_local = packed_full[:, local_index] if cp_size > 1 else packed_full

    # the padded boundaries in both the q/kv and the *_padded fields: padding is part of each span,
    # and causal attention keeps the real tokens unaffected; max_seqlen is the longest span (the
    # longest real length when nothing is padded)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens_padded,
        cu_seqlens_kv=cu_seqlens_padded,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    return PackedSequences(packed_full, packed_local, params, cu_seqlens, cu_seqlens_padded)


def cp_local_indices(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """`[T/CP]` long positions of the packed row that CP rank `cp_rank` holds: the zigzag shard
    of each span of `cu_seqlens_padded [B+1]` (each a multiple of `2*CP`), concatenated."""
    bounds = cu_seqlens_padded.tolist()
    device = cu_seqlens_padded.device
    pieces = [
        get_tokens_on_this_cp_rank(
            torch.arange(start, end, device=device), cp_rank, cp_size, seq_dim=0
        )
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(pieces)


def restore_packed_from_cp_shards(
    shards: list[torch.Tensor], cu_seqlens_padded: torch.Tensor
) -> torch.Tensor:
    """The full packed row `[1, T, ...]` from every CP rank's local row `[1, T/CP, ...]` (rank `r`
    at index `r`), span by span."""
    cp_size = len(shards)
    # a rank holds 1/CP of every span, starting at the span's start / CP
    bounds = [b // cp_size for b in cu_seqlens_padded.tolist()]
    spans = [
        restore_from_cp_shards([shard[:, start:end] for shard in shards], seq_dim=1)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(spans, dim=1) if spans else shards[0][:, :0]


def packed_position_ids(
    cu_seqlens_padded: torch.Tensor, cp_rank: int = 0, cp_size: int = 1
) -> torch.Tensor:
    """Per-document position ids `[1, T/CP]` of the packed row (restarting at 0 in every span),
    laid out like `packed_local`."""
    total = int(cu_seqlens_padded[-1])
    device = cu_seqlens_padded.device
    spans = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens_padded[:-1].long(), spans, output_size=total)
    # learned absolute position embeddings need these; RoPE derives positions from cu_seqlens
    positions = torch.arange(total, device=device) - starts
    if cp_size > 1:
        positions = positions[cp_local_indices(cu_seqlens_padded, cp_rank, cp_size)]
    return positions[None, :]


def unpack_sequences(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    width: int,
    pad_value: float = 0.0,
) -> torch.Tensor:
    """Inverse of packing: each span's real tokens of the full `packed [1, T, ...]` back into
    right-padded rows `[B, S, ...]` (`S` = `width`, beyond each length `pad_value`).

    Raises:
        ValueError: `width` is smaller than the longest real length.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if lengths.numel() and int(lengths.max()) > width:
        raise ValueError(
            f"`width`={width} is smaller than the longest sequence {int(lengths.max())}"
        )
    device = packed.device
    real = torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]  # [B, S]
    source = cu_seqlens_padded[:-1, None].long().to(device) + torch.arange(width, device=device)
    out = packed.new_full((lengths.numel(), width, *packed.shape[2:]), pad_value)
    out[real] = packed[0, source[real]]
    return out


def _prefix_sums(values: list[int], device: torch.device) -> torch.Tensor:
    cumulative = [0]
    for value in values:
        cumulative.append(cumulative[-1] + value)
    # int32: the dtype megatron's and Transformer Engine's THD kernels take for cu_seqlens
    return torch.tensor(cumulative, dtype=torch.int32, device=device)


def _check_pack_inputs(
    input_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    pad_individual: int,
    pad_packed_multiple: int,
) -> list[int]:
    if input_ids.ndim != 2:
        raise ValueError(f"`input_ids` must be [B, S], got shape {tuple(input_ids.shape)}")
    batch, width = input_ids.shape
    if batch == 0:
        raise ValueError("`input_ids` holds no sequences (B=0); nothing to pack")
    if seq_lengths.shape != (batch,):
        raise ValueError(
            f"`seq_lengths` must have shape [B]=({batch},), got {tuple(seq_lengths.shape)}"
        )
    if seq_lengths.is_floating_point():
        raise TypeError(f"`seq_lengths` must be an integer tensor, got {seq_lengths.dtype}")
    # one host sync: the spans are laid out on the host
    lengths = [int(length) for length in seq_lengths.tolist()]
    if min(lengths) < 0 or max(lengths) > width:
        raise ValueError(
            f"`seq_lengths` must lie in [0, S={width}], got min {min(lengths)}, max {max(lengths)}"
        )
    for name, value in (
        ("pad_individual", pad_individual),
        ("pad_packed_multiple", pad_packed_multiple),
    ):
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}")
    return lengths
