"""From a global batch to the ``ProcessedMicrobatch`` stream the forward step consumes (spec §6.3).

:func:`process_global_batch` computes the global valid counts once over the data-parallel group
and splits the batch into fixed-size microbatches; :func:`process_microbatch` builds one
microbatch's model inputs, padded (causal mask + position ids) or packed into one THD row
(:func:`~lightning_mcore_rl.data.pack_sequences`, per-document position ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.data import (
    BatchedDataDict,
    compute_global_valid_counts,
    pack_sequences,
    packed_position_ids,
)


@dataclass
class ProcessedMicrobatch:
    """One microbatch, ready for ``model_forward``.

    Attributes:
        data_dict: The unpacked microbatch ``[B, S, ...]`` the losses read.
        input_ids: Model ids: ``[B, S_pad]`` padded, or the full packed row ``[1, T]``.
        input_ids_cp_sharded: This CP rank's ids: ``[B, S_pad]`` or ``[1, T/CP]``.
        attention_mask: ``[1, 1, S_pad, S_pad]`` bool causal mask (True = masked); ``None`` packed.
        position_ids: ``[B, S_pad]``, or per-document ``[1, T/CP]`` when packed.
        packed_seq_params: Megatron ``PackedSeqParams`` (``None`` when padded).
        cu_seqlens_padded: ``[B+1]`` span boundaries (``None`` when padded).
        original_seq_length: ``S`` before dense padding.
        mtp_loss_mask: MTP loss mask (``None``: no MTP).
        padding_mask: MoE-routing padding mask (``None``: not used).
    """

    data_dict: BatchedDataDict
    input_ids: Tensor
    input_ids_cp_sharded: Tensor
    attention_mask: Tensor | None
    position_ids: Tensor | None
    packed_seq_params: Any
    cu_seqlens_padded: Tensor | None
    original_seq_length: int
    mtp_loss_mask: Tensor | None = None
    padding_mask: Tensor | None = None


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Megatron's boolean left-to-right mask ``[1, 1, S, S]``: True where attention is masked."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def process_microbatch(
    data_dict: BatchedDataDict,
    *,
    sequence_packing: bool = False,
    seq_length_key: str = "input_lengths",
    pad_individual: int = 1,
    pad_packed_multiple: int = 1,
    pad_packed_to: int | None = None,
    pad_full_seq_to: int | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> ProcessedMicrobatch:
    """Build the model inputs of one microbatch.

    Args:
        data_dict: ``input_ids [B, S]`` (+ ``input_lengths [B]`` when packing) and loss fields.
        sequence_packing: Pack into one THD row.
        seq_length_key: Key of the real lengths ``[B]`` (packing).
        pad_individual: Per-sequence span multiple (``2*CP`` with CP; see
            :func:`~lightning_mcore_rl.data.get_pack_sequence_parameters`).
        pad_packed_multiple: Packed-total multiple.
        pad_packed_to: Exact packed length ``T`` (pipeline parallelism needs equal shapes).
        pad_full_seq_to: Padded layout only: right-pad the model ids to this width (equal
            shapes across microbatches for pipeline parallelism).
        cp_rank: Context-parallel rank.
        cp_size: ``CP``; the padded layout supports CP = 1 only.

    Returns:
        The :class:`ProcessedMicrobatch`.

    Raises:
        ValueError: Missing lengths when packing, CP > 1 without packing, bad pad width.
    """
    input_ids = data_dict["input_ids"]
    batch, width = input_ids.shape
    if sequence_packing:
        if seq_length_key not in data_dict:
            raise ValueError(
                f"sequence packing needs the real lengths `{seq_length_key}` [B] in the batch; "
                f"keys: {sorted(data_dict)}"
            )
        packed = pack_sequences(
            input_ids, torch.as_tensor(data_dict[seq_length_key]), pad_individual,
            pad_packed_multiple, pad_packed_to, cp_rank, cp_size,
        )  # fmt: skip
        return ProcessedMicrobatch(
            data_dict=data_dict,
            input_ids=packed.packed_full,
            input_ids_cp_sharded=packed.packed_local,
            attention_mask=None,
            position_ids=packed_position_ids(packed.cu_seqlens_padded, cp_rank, cp_size),
            packed_seq_params=packed.packed_seq_params,
            cu_seqlens_padded=packed.cu_seqlens_padded,
            original_seq_length=width,
        )
    if cp_size > 1:
        raise ValueError("Context Parallelism (CP>1) requires sequence packing to be enabled.")
    model_ids = input_ids
    if pad_full_seq_to is not None:
        if pad_full_seq_to < width:
            raise ValueError(f"`pad_full_seq_to`={pad_full_seq_to} is below the width S={width}")
        model_ids = torch.nn.functional.pad(input_ids, (0, pad_full_seq_to - width))
    padded_width = model_ids.shape[1]
    position_ids = torch.arange(padded_width, device=input_ids.device).expand(batch, -1)
    return ProcessedMicrobatch(
        data_dict=data_dict,
        input_ids=model_ids,
        input_ids_cp_sharded=model_ids,
        attention_mask=causal_attention_mask(padded_width, input_ids.device),
        position_ids=position_ids,
        packed_seq_params=None,
        cu_seqlens_padded=None,
        original_seq_length=width,
    )


@dataclass
class GlobalBatch:
    """This DP rank's share of one global batch, split into processed microbatches.

    Attributes:
        microbatches: The processed microbatches, in order.
        global_valid_seqs: ``sum(sample_mask)`` over the DP group (0-d).
        global_valid_toks: ``sum(token_mask[:, 1:] * sample_mask)`` over the DP group (0-d).
        seq_length: The schedule's ``seq_length`` (model input width; ``T`` when packed).
        micro_batch_size: The schedule's ``micro_batch_size`` (1 when packed).
    """

    microbatches: list[ProcessedMicrobatch]
    global_valid_seqs: Tensor
    global_valid_toks: Tensor
    seq_length: int
    micro_batch_size: int

    @property
    def num_microbatches(self) -> int:
        """``M``."""
        return len(self.microbatches)

    def iterator(self) -> Iterator[ProcessedMicrobatch]:
        """A fresh iterator over the microbatches (one per model chunk with VPP)."""
        return iter(self.microbatches)


def process_global_batch(
    batch: BatchedDataDict,
    dp_group: Any,
    micro_batch_size: int,
    *,
    equal_shapes: bool = False,
    **microbatch_kwargs: Any,
) -> GlobalBatch:
    """Global valid counts once over DP, then fixed-size processed microbatches.

    Args:
        batch: This DP rank's share of the global batch (``sample_mask`` required).
        dp_group: The data-parallel group (never DP x CP: CP ranks hold identical data).
        micro_batch_size: Samples per microbatch; must divide the batch.
        equal_shapes: Pad every packed microbatch to the longest one (``pad_packed_to``): megatron's
            pipeline p2p sends one ``[seq_length, mbs, hidden]`` shape for all microbatches, so
            pipeline parallelism needs it (the padded layout has equal shapes already).
        **microbatch_kwargs: Forwarded to :func:`process_microbatch` (packing, CP rank/size...).

    Returns:
        The :class:`GlobalBatch`.

    Raises:
        ValueError: ``micro_batch_size`` does not divide the local batch size.
    """
    size = batch.size
    if micro_batch_size < 1 or size % micro_batch_size != 0:
        raise ValueError(
            f"the local batch size {size} must be divisible by micro_batch_size {micro_batch_size}"
        )
    counts = compute_global_valid_counts(batch, dp_group)
    microbatches = [
        process_microbatch(mb, **microbatch_kwargs)
        for mb in batch.make_microbatch_iterator(micro_batch_size)
    ]
    packed = microbatches[0].packed_seq_params is not None
    seq_length = max(mb.input_ids_cp_sharded.shape[1] for mb in microbatches)
    if packed and equal_shapes and microbatch_kwargs.get("pad_packed_to") is None:
        # The longest packed row is a multiple of every padding knob already: reuse its length.
        longest = max(mb.input_ids.shape[1] for mb in microbatches)
        microbatches = [
            mb
            if mb.input_ids.shape[1] == longest
            else process_microbatch(mb.data_dict, **microbatch_kwargs, pad_packed_to=longest)
            for mb in microbatches
        ]
    cp_size = int(microbatch_kwargs.get("cp_size", 1))
    return GlobalBatch(
        microbatches=microbatches,
        global_valid_seqs=counts.global_valid_seqs,
        global_valid_toks=counts.global_valid_toks,
        seq_length=seq_length * cp_size,
        micro_batch_size=1 if packed else micro_batch_size,
    )
