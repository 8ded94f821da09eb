"""Token-budget (dynamic) microbatching and global valid counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from lightning_mcore_rl.data.batched_data_dict import BatchedDataDict
from lightning_mcore_rl.data.packing import round_up

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


# RL rollouts have long-tailed lengths: a fixed number of sequences per microbatch wastes compute on
# padding or runs out of memory on the long tail. Each DP rank groups its sequences by token cost
# instead; the ranks then agree on one microbatch count (megatron's schedule runs the same number on
# every rank) by splitting their largest microbatches
def microbatch_cost(lengths: Sequence[int], *, packed: bool, pad_individual: int = 1) -> int:
    """Tokens a microbatch of sequences of `lengths` processes: `sum(round_up(len, pad))` when
    `packed` (THD), `n * round_up(max(len), pad)` when padded."""
    if not lengths:
        return 0
    if packed:
        return sum(round_up(length, pad_individual) for length in lengths)
    return len(lengths) * round_up(max(lengths), pad_individual)


@dataclass(frozen=True)
class MicrobatchPlan:
    """Assignment of a batch's samples to microbatches: per microbatch its sample `indices`
    (increasing) and its `costs` (`microbatch_cost`)."""

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
    """Group sequences of `seq_lengths [B]` into microbatches whose `microbatch_cost` (`packed`,
    `pad_individual`) fits the token budget, at least `min_num_microbatches` of them.

    Raises:
        ValueError: empty batch, a budget below the longest sequence's cost, or
            `min_num_microbatches` above the number of sequences.
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
        # first-fit decreasing: longest first, into the first microbatch that stays within the
        # budget
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
        # split the costliest microbatch of >= 2 sequences in two: splitting never raises a cost, so
        # the budget still holds; split-off microbatches come last
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
        # greedy balanced halves: longest first, to the half with the smaller sum
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
        """Per-microbatch outputs `[b_i, ...]` or `[b_i, s_i, ...]` concatenated in input order:
        `[B, ...]` (per-token: right-padded with `pad_value` to `[B, S, ...]`)."""
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
    """Split this data-parallel rank's batch (`input_ids [B, S]`, `length_key [B]`) into
    token-budget microbatches, equal in number on every rank of `dp_group` (one all-reduce MAX),
    each trimmed to `min(S, round_up(longest, pad_individual))`.

    Raises:
        ValueError: before any collective, if `length_key` is missing, lengths exceed `S`, or the
            budget is below the longest sequence; after it, if this rank has fewer sequences than
            the DP-wide microbatch count.
    """
    import torch.distributed as dist

    batch.validate(required_keys=("input_ids", length_key), length_key=length_key)
    width = batch.sequence_width()
    # the plan is built on the host: one sync for all lengths
    lengths = torch.as_tensor(batch[length_key]).tolist()
    local = plan_token_budget_microbatches(
        lengths, max_tokens_per_microbatch, packed=packed, pad_individual=pad_individual
    )
    # on the batch's device: NCCL reduces CUDA tensors only, gloo CPU ones
    input_ids = cast(torch.Tensor, batch["input_ids"])  # validate() checked: a [B, S] tensor
    count = torch.tensor([local.num_microbatches], dtype=torch.long, device=input_ids.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    target = int(count.item())
    # ranks must hold equal sample counts: a rank cannot make more microbatches than it has
    # sequences
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
        # trimmed to its own longest sequence: columns beyond it would be padding computed for
        # nothing (at least 1 wide for an all-empty microbatch)
        trimmed = min(width, max(1, round_up(longest, pad_individual)))
        microbatches.append(batch.select_indices(list(index)).truncate_width(trimmed))
    return TokenBudgetMicrobatches(microbatches, plan, width)


class GlobalValidCounts(NamedTuple):
    """Normalisers shared by every microbatch's loss in one global batch
    (docs/behaviour-reference.md §2.10)."""

    global_valid_seqs: torch.Tensor
    """0-d float32: ``sum(sample_mask)`` over the data-parallel group."""
    global_valid_toks: torch.Tensor
    """0-d float32: ``sum(token_mask[:, 1:] * sample_mask)`` over the data-parallel group."""


def compute_global_valid_counts(
    batch: BatchedDataDict, dp_group: ProcessGroup
) -> GlobalValidCounts:
    """Valid sequence and token counts of the global batch (`sample_mask [B]`, optional
    `token_mask [B, S]`), summed over data parallelism only, on `sample_mask`'s device.

    Raises:
        ValueError: `sample_mask` missing or not `[B]`, `token_mask` not `[B, S]`.
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
    # summed over DP only: CP ranks hold identical data, so DP x CP would over-count
    # (docs/behaviour-reference.md trap 4)
    valid_seqs = sample_mask.double().sum()
    if "token_mask" in batch:
        token_mask = torch.as_tensor(batch["token_mask"])
        if token_mask.ndim != 2 or token_mask.shape[0] != sample_mask.shape[0]:
            raise ValueError(
                f"`token_mask` must be [B, S] with B={sample_mask.shape[0]}, got shape "
                f"{tuple(token_mask.shape)}"
            )
        # position 0 is never predicted (next-token convention): the loss sees S-1 tokens per row
        valid_toks = (token_mask[:, 1:].double() * sample_mask.double()[:, None]).sum()
    else:
        # without `token_mask` every position counts
        valid_toks = valid_seqs * batch.sequence_width()
    counts = torch.stack([valid_seqs, valid_toks])  # [2]: one collective for both
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    counts = counts.float()
    return GlobalValidCounts(counts[0], counts[1])
