"""From a global batch to the `ProcessedMicrobatch` stream the forward step consumes."""

# docs/behaviour-reference.md §6.3: `process_global_batch` (global valid counts once over DP,
# fixed-size or token-budget microbatches) and `process_microbatch` (one microbatch's model
# inputs, padded or packed into one THD row).

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from lightning_mcore_rl.data import (
    BatchedDataDict,
    TokenBudgetMicrobatches,
    compute_global_valid_counts,
    make_token_budget_microbatches,
    minimum_pad_individual,
    pack_sequences,
    packed_position_ids,
    round_up,
)
from lightning_mcore_rl.data.packed_checks import shared_causal_mask


@dataclass
class ProcessedMicrobatch:
    """One microbatch, ready for `model_forward`."""

    data_dict: BatchedDataDict  # the unpacked microbatch `[B, S, ...]` the losses read
    input_ids: Tensor  # model ids: `[B, S_pad]` padded, or the full packed row `[1, T]`
    input_ids_cp_sharded: Tensor  # this CP rank's ids: `[B, S_pad]` or `[1, T/CP]`
    # `[1, 1, S_pad, S_pad]` bool causal mask (True = masked); `None` packed
    attention_mask: Tensor | None
    position_ids: Tensor | None  # `[B, S_pad]`, or per-document `[1, T/CP]` when packed
    packed_seq_params: Any  # megatron `PackedSeqParams` (`None` when padded)
    cu_seqlens_padded: Tensor | None  # `[B+1]` span boundaries (`None` when padded)
    original_seq_length: int  # `S` before dense padding
    # MTP: `token_mask * sample_mask` in the model ids' layout (`[B, S_pad]` or `[1, T/CP]`);
    # `None` without MTP
    mtp_loss_mask: Tensor | None = None
    # MoE: the routers' padding mask in the model's input layout, True at padding (`[B, S_pad]`
    # or `[1, T/CP]`); `None` for dense models
    padding_mask: Tensor | None = None
    # router replay: `routed_experts` in the routers' token order before SP, `[S_pad * B, L, K]`
    # (sequence-first) or `[T/CP, L, K]`; `None` without the batch key
    routed_experts_cp_sharded: Tensor | None = None


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> Tensor:
    """Megatron's boolean left-to-right mask `[1, 1, S, S]`: True where attention is masked."""
    # shared per `(S, device)` (`shared_causal_mask`): the local attention recognises it without
    # reading it, so nobody may modify it in place
    return shared_causal_mask(seq_len, torch.device(device))


def process_microbatch(
    data_dict: BatchedDataDict,
    *,
    sequence_packing: bool = False,
    seq_length_key: str = "input_lengths",
    pad_individual: int = 1,
    pad_packed_multiple: int = 1,
    pad_packed_to: int | None = None,
    pad_full_seq_to: int | None = None,
    pad_width_multiple: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    routing: bool = False,
    mtp: bool = False,
) -> ProcessedMicrobatch:
    """The model inputs of one microbatch, padded or packed into one THD row.

    `input_ids [B, S]`, `input_lengths [B]` when packed, and the loss fields.

    Args:
        pad_individual: per-sequence span multiple (`layout_padding`).
        pad_packed_to: exact packed length `T` (pipeline parallelism needs equal shapes).
        pad_full_seq_to: padded layout: right-pad the model ids to this width.
        pad_width_multiple: padded layout: right-pad the model ids to a multiple of this.
        cp_size: `CP`; the padded layout supports CP = 1 only.
        routing: also build the MoE routers' `padding_mask` and `routed_experts` order.
        mtp: also build the MTP `mtp_loss_mask`.

    Raises:
        ValueError: missing lengths when packing, CP > 1 without packing, bad pad width.
    """
    input_ids = cast(Tensor, data_dict["input_ids"])  # [B, S] by the BatchedDataDict contract
    batch, width = input_ids.shape
    if sequence_packing:
        if seq_length_key not in data_dict:
            raise ValueError(
                f"sequence packing needs the real lengths `{seq_length_key}` [B] in the batch; "
                f"keys: {sorted(data_dict)}"
            )
        lengths = torch.as_tensor(data_dict[seq_length_key])
        packed = pack_sequences(
            input_ids, lengths, pad_individual, pad_packed_multiple, pad_packed_to, cp_rank,
            cp_size,
        )  # fmt: skip
        token_index = mtp_loss_mask = None
        if mtp:  # [1, T/CP], packed like the ids
            mtp_loss_mask = pack_sequences(
                _response_mask(data_dict), lengths, pad_individual, pad_packed_multiple,
                pad_packed_to, cp_rank, cp_size,
            ).packed_local  # fmt: skip
        if routing:
            # the MoE extension's token order, imported only for a model with routers
            from lightning_mcore_rl.extensions.moe.router_replay import (
                packable_token_ids,
                routed_token_index,
            )

            located = pack_sequences(
                packable_token_ids(batch, width, input_ids.device), lengths, pad_individual,
                pad_packed_multiple, pad_packed_to, cp_rank, cp_size,
            ).packed_local  # fmt: skip
            token_index = routed_token_index(batch, width, lengths, packed_index=located)
        return ProcessedMicrobatch(
            data_dict=data_dict,
            input_ids=packed.packed_full,
            input_ids_cp_sharded=packed.packed_local,
            attention_mask=None,
            position_ids=packed_position_ids(packed.cu_seqlens_padded, cp_rank, cp_size),
            packed_seq_params=packed.packed_seq_params,
            cu_seqlens_padded=packed.cu_seqlens_padded,
            original_seq_length=width,
            padding_mask=None if token_index is None else (token_index < 0)[None, :],  # [1, T/CP]
            routed_experts_cp_sharded=_routed_experts(data_dict, token_index),
            mtp_loss_mask=mtp_loss_mask,
        )
    if cp_size > 1:
        raise ValueError("Context Parallelism (CP>1) requires sequence packing to be enabled.")
    model_width = round_up(width, pad_width_multiple)
    if pad_full_seq_to is not None:
        if pad_full_seq_to < width or pad_full_seq_to % pad_width_multiple != 0:
            raise ValueError(
                f"`pad_full_seq_to`={pad_full_seq_to} must be >= the width S={width} and a "
                f"multiple of `pad_width_multiple`={pad_width_multiple}"
            )
        model_width = pad_full_seq_to
    model_ids = input_ids
    if model_width > width:
        model_ids = torch.nn.functional.pad(input_ids, (0, model_width - width))
    padded_width = model_ids.shape[1]
    position_ids = torch.arange(padded_width, device=input_ids.device).expand(batch, -1)
    token_index = padding_mask = None
    if routing:
        from lightning_mcore_rl.extensions.moe.router_replay import routed_token_index

        row_lengths = data_dict.get(seq_length_key)
        token_index = routed_token_index(
            batch, width, None if row_lengths is None else torch.as_tensor(row_lengths),
            model_width=padded_width, device=input_ids.device,
        )  # fmt: skip  # [S_pad * B], sequence-first
        padding_mask = (token_index < 0).view(padded_width, batch).transpose(0, 1)  # [B, S_pad]
    return ProcessedMicrobatch(
        data_dict=data_dict,
        input_ids=model_ids,
        input_ids_cp_sharded=model_ids,
        attention_mask=causal_attention_mask(padded_width, input_ids.device),
        position_ids=position_ids,
        packed_seq_params=None,
        cu_seqlens_padded=None,
        original_seq_length=width,
        padding_mask=padding_mask,
        routed_experts_cp_sharded=_routed_experts(data_dict, token_index),
        mtp_loss_mask=None
        if not mtp
        else torch.nn.functional.pad(_response_mask(data_dict), (0, padded_width - width)),
    )


def _response_mask(data_dict: BatchedDataDict) -> Tensor:
    """``token_mask * sample_mask`` ``[B, S]`` (fp32): the tokens a loss scores."""
    token_mask = torch.as_tensor(data_dict["token_mask"]).float()
    sample_mask = torch.as_tensor(data_dict["sample_mask"]).float()
    return token_mask * sample_mask[:, None]


def _routed_experts(data_dict: BatchedDataDict, token_index: Tensor | None) -> Tensor | None:
    """``routed_experts`` in the routers' token order, or ``None`` without the key (or without
    routers: ``token_index`` ``None``)."""
    if token_index is None:
        return None
    from lightning_mcore_rl.extensions.moe.router_replay import (
        ROUTED_EXPERTS,
        routed_experts_in_model_order,
    )

    if ROUTED_EXPERTS not in data_dict:
        return None
    return routed_experts_in_model_order(cast(Tensor, data_dict[ROUTED_EXPERTS]), token_index)


def layout_padding(
    *, sequence_packing: bool, tp_size: int, cp_size: int, sequence_parallel: bool
) -> dict[str, int]:
    """The padding the parallel layout needs, as `process_microbatch` keyword arguments:
    `{"pad_individual": n}` packed, `{"pad_width_multiple": n}` padded (`[B, S]`)."""
    sp_tp = tp_size if sequence_parallel else 1
    if not sequence_packing:  # padded: the width a multiple of TP under SP
        return {"pad_width_multiple": sp_tp}
    # packed: every span a multiple of (2*CP if CP > 1) * (TP if SP) (CP's zigzag cuts each span
    # into 2*CP chunks; SP then splits the rank's T/CP tokens over TP), so the total is one too
    return {
        "pad_individual": minimum_pad_individual(
            tensor_model_parallel_size=tp_size,
            sequence_parallel=sequence_parallel,
            context_parallel_size=cp_size,
        )
    }


@dataclass
class GlobalBatch:
    """This DP rank's share of one global batch, split into processed microbatches."""

    microbatches: list[ProcessedMicrobatch]
    global_valid_seqs: Tensor  # `sum(sample_mask)` over the DP group (0-d)
    global_valid_toks: Tensor  # `sum(token_mask[:, 1:] * sample_mask)` over the DP group (0-d)
    seq_length: int  # the schedule's `seq_length` (model input width; `T` when packed)
    # the schedule's `micro_batch_size`: 1 when packed; with padded token-budget microbatches the
    # largest microbatch (unused without pipelining)
    micro_batch_size: int
    # the token-budget split (`None`: fixed-size microbatches in input order)
    token_budget: TokenBudgetMicrobatches | None = None

    @property
    def num_microbatches(self) -> int:
        """``M``."""
        return len(self.microbatches)

    def iterator(self) -> Iterator[ProcessedMicrobatch]:
        """A fresh iterator over the microbatches (one per model chunk with VPP)."""
        return iter(self.microbatches)

    def restore_order(self, outputs: list[Tensor], pad_value: float = 0.0) -> Tensor:
        """Per-microbatch outputs `[b_i, ...]` / `[b_i, s_i, ...]` -> `[B, ...]` / `[B, S, ...]`
        in the input batch's sample order."""
        # token-budget microbatches hold reordered samples and are trimmed to their longest
        # sequence; narrower per-token outputs are right-padded with `pad_value`
        if self.token_budget is not None:
            return self.token_budget.restore_order(outputs, pad_value)
        return torch.cat(outputs)


def process_global_batch(
    batch: BatchedDataDict,
    dp_group: Any,
    micro_batch_size: int,
    *,
    equal_shapes: bool = False,
    max_tokens_per_microbatch: int | None = None,
    **microbatch_kwargs: Any,
) -> GlobalBatch:
    """Global valid counts once over DP, then processed microbatches (fixed-size, or token-budget
    ones when `max_tokens_per_microbatch` is set).

    Args:
        batch: this DP rank's share of the global batch (`sample_mask`; a budget: the lengths too).
        dp_group: the data-parallel group (never DP x CP: CP ranks hold identical data).
        micro_batch_size: samples per microbatch; must divide the batch (ignored with a budget).
        equal_shapes: pad every packed microbatch to the longest one (pipeline parallelism).
        max_tokens_per_microbatch: token budget per microbatch (`data.microbatch_cost`).
        **microbatch_kwargs: forwarded to `process_microbatch` (packing, CP rank/size...).

    Raises:
        ValueError: `micro_batch_size` does not divide the local batch; a bad budget; padded
            token-budget microbatches with `equal_shapes`.
    """
    # all raised before any collective
    check_microbatching(
        micro_batch_size if max_tokens_per_microbatch is None else 1,  # ignored with a budget
        max_tokens_per_microbatch,
        sequence_packing=bool(microbatch_kwargs.get("sequence_packing", False)),
        equal_shapes=equal_shapes,
    )
    budget: TokenBudgetMicrobatches | None = None
    if max_tokens_per_microbatch is None:
        size = batch.size
        if size % micro_batch_size != 0:
            raise ValueError(
                f"the local batch size {size} must be divisible by micro_batch_size "
                f"{micro_batch_size}"
            )
        data_microbatches = list(batch.make_microbatch_iterator(micro_batch_size))
    else:
        # every DP rank gets the same number of microbatches (one all-reduce MAX); samples are
        # regrouped and `GlobalBatch.restore_order` puts the outputs back
        budget = _token_budget_microbatches(
            batch, dp_group, max_tokens_per_microbatch, microbatch_kwargs
        )
        data_microbatches = budget.microbatches
    # on the whole local batch, once: every microbatch divides by the same global counts
    counts = compute_global_valid_counts(batch, dp_group)
    microbatches = [process_microbatch(mb, **microbatch_kwargs) for mb in data_microbatches]
    packed = microbatches[0].packed_seq_params is not None
    seq_length = max(mb.input_ids_cp_sharded.shape[1] for mb in microbatches)
    # megatron's pipeline p2p sends one [seq_length, mbs, hidden] shape for all microbatches
    # (padded microbatches have equal shapes already, except token-budget ones: they need packing)
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
        micro_batch_size=1 if packed else max(mb.input_ids.shape[0] for mb in microbatches),
        token_budget=budget,
    )


def check_microbatching(
    micro_batch_size: int,
    max_tokens_per_microbatch: int | None,
    *,
    sequence_packing: bool,
    equal_shapes: bool,
) -> None:
    """THE validation of a microbatching choice (host only, before any collective).

    Raises:
        ValueError: a bad `micro_batch_size` or `max_tokens_per_microbatch`; a budget with
            `micro_batch_size != 1`; a padded budget with `equal_shapes`.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(f"`micro_batch_size` must be a positive int, got {micro_batch_size!r}.")
    if micro_batch_size < 1:
        raise ValueError(f"`micro_batch_size` must be a positive int, got {micro_batch_size!r}.")
    if max_tokens_per_microbatch is None:
        return
    if (
        isinstance(max_tokens_per_microbatch, bool)
        or not isinstance(max_tokens_per_microbatch, int)
        or max_tokens_per_microbatch < 1
    ):
        raise ValueError(
            "`max_tokens_per_microbatch` must be a positive int or None, got "
            f"{max_tokens_per_microbatch!r}."
        )
    if micro_batch_size != 1:
        raise ValueError(
            f"`micro_batch_size={micro_batch_size}` contradicts "
            f"`max_tokens_per_microbatch={max_tokens_per_microbatch}`: with a token budget the "
            "budget decides how many samples each microbatch holds; leave micro_batch_size at 1."
        )
    # pipeline parallelism: padded budget microbatches hold different numbers of samples, and
    # megatron's p2p sends one `[seq_length, mbs, hidden]` shape
    if equal_shapes and not sequence_packing:
        raise ValueError(
            f"`max_tokens_per_microbatch={max_tokens_per_microbatch}` with pipeline parallelism "
            "needs `sequence_packing=True`: padded token-budget microbatches hold different "
            "numbers of samples, and megatron's pipeline p2p sends one shape for every "
            "microbatch."
        )


def _token_budget_microbatches(
    batch: BatchedDataDict,
    dp_group: Any,
    max_tokens_per_microbatch: int,
    microbatch_kwargs: dict[str, Any],
) -> TokenBudgetMicrobatches:
    """The DP-balanced token-budget split (validated by `check_microbatching`)."""
    # make_token_budget_microbatches checks the budget against the longest sequence before its
    # collective (the MAX of microbatch counts over DP).
    return make_token_budget_microbatches(
        batch,
        max_tokens_per_microbatch,
        dp_group,
        packed=bool(microbatch_kwargs.get("sequence_packing", False)),
        pad_individual=int(microbatch_kwargs.get("pad_individual", 1)),
        length_key=microbatch_kwargs.get("seq_length_key", "input_lengths"),
    )
