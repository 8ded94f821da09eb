"""Token-budget (dynamic) microbatching and global valid counts.

RL rollouts have long-tailed lengths, so a fixed number of sequences per microbatch either wastes
compute on padding or runs out of memory on the long tail. Here each data-parallel rank groups its
sequences into microbatches whose token cost fits ``max_tokens_per_microbatch`` (first-fit
decreasing), then the ranks agree on one microbatch count (Megatron's schedule runs the same number
of microbatches on every rank) by splitting their largest microbatches. Outputs computed per
microbatch are put back in input order with :meth:`TokenBudgetMicrobatches.restore_order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from lightning_mcore_rl.data.batched_data_dict import BatchedDataDict
from lightning_mcore_rl.data.packing import round_up

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def microbatch_cost(lengths: Sequence[int], *, packed: bool, pad_individual: int = 1) -> int:
    """Tokens a microbatch of sequences with ``lengths`` processes.

    Args:
        lengths: real lengths of the microbatch's sequences.
        packed: THD packing (sum of spans) rather than padding to the longest sequence.
        pad_individual: per-sequence multiple (packed span / padded width rounding).

    Returns:
        ``sum(round_up(len, pad))`` when packed, ``n * round_up(max(len), pad)`` when padded.
    """
    if not lengths:
        return 0
    if packed:
        return sum(round_up(length, pad_individual) for length in lengths)
    return len(lengths) * round_up(max(lengths), pad_individual)


@dataclass(frozen=True)
class MicrobatchPlan:
    """Assignment of a batch's samples to microbatches.

    Attributes:
        indices: per microbatch, the sample indices (increasing) into the local batch.
        costs: per microbatch, the tokens it processes (see :func:`microbatch_cost`).
    """

    indices: tuple[tuple[int, ...], ...]
    costs: tuple[int, ...]

    @property
    def num_microbatches(self) -> int:
        """Number of microbatches."""
        return len(self.indices)


def plan_token_budget_microbatches(
    seq_lengths: Sequence[int],
    max_tokens_per_microbatch: int,
    *,
    packed: bool = True,
    pad_individual: int = 1,
    min_num_microbatches: int = 1,
) -> MicrobatchPlan:
    """Group sequences into microbatches whose cost fits a token budget (first-fit decreasing).

    Sequences are visited longest first and placed in the first microbatch that stays within
    the budget. If fewer than ``min_num_microbatches`` result, the microbatch with the largest
    cost among those holding >= 2 sequences is split in two (greedy balanced halves) until the
    count is reached; splitting never raises a cost, so the budget still holds.

    Args:
        seq_lengths: real lengths ``[B]``.
        max_tokens_per_microbatch: token budget per microbatch.
        packed: cost as THD-packed (True) or padded to the microbatch's longest sequence.
        pad_individual: per-sequence rounding multiple used in the cost.
        min_num_microbatches: at least this many microbatches (e.g. the DP-wide maximum).

    Returns:
        The :class:`MicrobatchPlan`, microbatches in creation order (the first holds the longest
        sequence; split-off microbatches come last).

    Raises:
        ValueError: empty batch, a budget below the longest sequence's cost, or
            ``min_num_microbatches`` above the number of sequences.
    """
    lengths = [int(length) for length in seq_lengths]
    if not lengths:
        raise ValueError("cannot plan microbatches for an empty batch")
    if min(lengths) < 0:
        raise ValueError(f"sequence lengths must be >= 0, got min {min(lengths)}")
    longest = microbatch_cost([max(lengths)], packed=packed, pad_individual=pad_individual)
    if max_tokens_per_microbatch < longest:
        raise ValueError(
            f"`max_tokens_per_microbatch`={max_tokens_per_microbatch} is smaller than the longest "
            f"sequence ({max(lengths)} tokens, {longest} after padding to {pad_individual}); "
            "raise the budget to at least the longest sequence."
        )
    if not 1 <= min_num_microbatches <= len(lengths):
        raise ValueError(
            f"`min_num_microbatches`={min_num_microbatches} must be in [1, {len(lengths)}] "
            f"(the number of sequences)"
        )

    def cost(bin_: list[int]) -> int:
        return microbatch_cost(
            [lengths[i] for i in bin_], packed=packed, pad_individual=pad_individual
        )

    bins: list[list[int]] = []
    costs: list[int] = []  # running cost of each bin: O(1) per placement attempt
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        span = round_up(lengths[index], pad_individual)
        for b, bin_ in enumerate(bins):
            # visited longest first, so a padded bin's width is its first sequence's
            new_cost = costs[b] + (span if packed else costs[b] // len(bin_))
            if new_cost <= max_tokens_per_microbatch:
                bin_.append(index)
                costs[b] = new_cost
                break
        else:
            bins.append([index])
            costs.append(span)
    while len(bins) < min_num_microbatches:
        splittable = [b for b in bins if len(b) >= 2]
        largest = max(splittable, key=cost)
        bins.remove(largest)
        bins.extend(_split_in_two(largest, lengths))
    ordered = [tuple(sorted(bin_)) for bin_ in bins]
    return MicrobatchPlan(tuple(ordered), tuple(cost(list(b)) for b in ordered))


def _split_in_two(bin_: list[int], lengths: list[int]) -> list[list[int]]:
    halves: list[list[int]] = [[], []]
    sums = [0, 0]
    for index in sorted(bin_, key=lambda i: (-lengths[i], i)):
        target = 0 if (sums[0], len(halves[0])) <= (sums[1], len(halves[1])) else 1
        halves[target].append(index)
        sums[target] += lengths[index]
    return halves


class TokenBudgetMicrobatches(NamedTuple):
    """Microbatches of one data-parallel rank and how to put their outputs back in order."""

    microbatches: list[BatchedDataDict]
    """Microbatches; per-token tensors are trimmed to each microbatch's rounded longest length."""
    plan: MicrobatchPlan
    """Which input samples each microbatch holds."""
    width: int
    """``S`` of the input batch (the width restored outputs are padded back to)."""

    def restore_order(
        self, outputs: Sequence[torch.Tensor], pad_value: float = 0.0
    ) -> torch.Tensor:
        """Concatenate per-microbatch outputs and put the samples back in input order.

        Args:
            outputs: per microbatch, ``[b_i, ...]`` or ``[b_i, s_i, ...]`` (e.g. logprobs);
                per-token outputs narrower than the input are right-padded.
            pad_value: fill for the padded positions.

        Returns:
            ``[B, ...]`` (per-token outputs ``[B, S, ...]``) in the input batch's order.
        """
        if len(outputs) != self.plan.num_microbatches:
            raise ValueError(
                f"got {len(outputs)} outputs for {self.plan.num_microbatches} microbatches"
            )
        for output, index in zip(outputs, self.plan.indices, strict=True):
            if output.shape[0] != len(index):
                raise ValueError(
                    f"an output has {output.shape[0]} rows but its microbatch holds {len(index)}"
                )
        if outputs[0].ndim >= 2:
            outputs = [
                torch.nn.functional.pad(
                    out, (0, 0) * (out.ndim - 2) + (0, self.width - out.shape[1]), value=pad_value
                )
                for out in outputs
            ]
        order = torch.tensor([i for index in self.plan.indices for i in index], dtype=torch.long)
        restored = torch.empty_like(torch.cat(list(outputs)))  # cat takes a list or tuple
        restored[order.to(restored.device)] = torch.cat(list(outputs))
        return restored


def make_token_budget_microbatches(
    batch: BatchedDataDict,
    max_tokens_per_microbatch: int,
    dp_group: ProcessGroup,
    *,
    packed: bool = True,
    pad_individual: int = 1,
    length_key: str = "input_lengths",
) -> TokenBudgetMicrobatches:
    """Split this data-parallel rank's batch into token-budget microbatches, equal in number on
    every rank of ``dp_group`` (one all-reduce MAX of the count).

    Args:
        batch: this rank's samples, with ``input_ids [B,S]`` and ``length_key [B]``.
        max_tokens_per_microbatch: token budget (see :func:`microbatch_cost`).
        dp_group: the data-parallel group (every rank must call this).
        packed: budget as THD-packed microbatches (else padded to each microbatch's longest).
        pad_individual: per-sequence multiple used for costs and for the trimmed width.
        length_key: per-sample real length key.

    Returns:
        :class:`TokenBudgetMicrobatches`; every microbatch's per-token tensors are trimmed to
        ``min(S, round_up(longest, pad_individual))``.

    Raises:
        ValueError: before any collective, if ``length_key`` is missing, lengths exceed ``S``, or
            the budget is below the longest sequence; after it, if this rank has fewer sequences
            than the DP-wide microbatch count (ranks must hold equal sample counts).
    """
    import torch.distributed as dist

    batch.validate(required_keys=("input_ids", length_key), length_key=length_key)
    width = batch.sequence_width()
    lengths = torch.as_tensor(batch[length_key]).tolist()
    local = plan_token_budget_microbatches(
        lengths, max_tokens_per_microbatch, packed=packed, pad_individual=pad_individual
    )
    # on the batch's device: NCCL reduces CUDA tensors only, gloo CPU ones
    input_ids = cast(torch.Tensor, batch["input_ids"])  # validate() checked: a [B, S] tensor
    count = torch.tensor([local.num_microbatches], dtype=torch.long, device=input_ids.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    target = int(count.item())
    if target > len(lengths):
        raise ValueError(
            f"this data-parallel rank holds {len(lengths)} sequences but another rank needs "
            f"{target} microbatches; shard the global batch evenly (shard_by_batch_size)."
        )
    plan = (
        local
        if target == local.num_microbatches
        else plan_token_budget_microbatches(
            lengths,
            max_tokens_per_microbatch,
            packed=packed,
            pad_individual=pad_individual,
            min_num_microbatches=target,
        )
    )
    microbatches = []
    for index in plan.indices:
        longest = max(lengths[i] for i in index)
        trimmed = min(width, max(1, round_up(longest, pad_individual)))
        microbatches.append(batch.select_indices(list(index)).truncate_width(trimmed))
    return TokenBudgetMicrobatches(microbatches, plan, width)


class GlobalValidCounts(NamedTuple):
    """Normalisers shared by every microbatch's loss in one global batch.

    See docs/behaviour-reference.md §2.10.
    """

    global_valid_seqs: torch.Tensor
    """0-d float32: ``sum(sample_mask)`` over the data-parallel group."""
    global_valid_toks: torch.Tensor
    """0-d float32: ``sum(token_mask[:, 1:] * sample_mask)`` over the data-parallel group."""


def compute_global_valid_counts(
    batch: BatchedDataDict, dp_group: ProcessGroup
) -> GlobalValidCounts:
    """Valid sequence and token counts of the global batch, summed over data parallelism only.

    Context-parallel ranks hold identical data, so summing over DP x CP would over-count
    (docs/behaviour-reference.md trap 4). Both counts travel in one all-reduce. Without
    ``token_mask`` every position counts: ``local_valid_toks = local_valid_seqs * S``.

    Args:
        batch: this DP rank's share of the global batch: ``sample_mask [B]``, optional
            ``token_mask [B,S]`` (and ``input_ids [B,S]`` for ``S`` when ``token_mask`` is absent).
        dp_group: the data-parallel process group.

    Returns:
        :class:`GlobalValidCounts` on ``sample_mask``'s device.

    Raises:
        ValueError: ``sample_mask`` missing or not ``[B]``, ``token_mask`` not ``[B, S]``.
    """
    import torch.distributed as dist

    if "sample_mask" not in batch:
        raise ValueError(
            f"`sample_mask` must be present in the data to compute global valid counts; keys: "
            f"{sorted(batch)}"
        )
    sample_mask = torch.as_tensor(batch["sample_mask"])
    if sample_mask.ndim != 1:
        raise ValueError(f"`sample_mask` must be [B], got shape {tuple(sample_mask.shape)}")
    valid_seqs = sample_mask.double().sum()
    if "token_mask" in batch:
        token_mask = torch.as_tensor(batch["token_mask"])
        if token_mask.ndim != 2 or token_mask.shape[0] != sample_mask.shape[0]:
            raise ValueError(
                f"`token_mask` must be [B, S] with B={sample_mask.shape[0]}, got shape "
                f"{tuple(token_mask.shape)}"
            )
        valid_toks = (token_mask[:, 1:].double() * sample_mask.double()[:, None]).sum()
    else:
        valid_toks = valid_seqs * batch.sequence_width()
    counts = torch.stack([valid_seqs, valid_toks])  # [2]: one collective for both
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    counts = counts.float()
    return GlobalValidCounts(counts[0], counts[1])
