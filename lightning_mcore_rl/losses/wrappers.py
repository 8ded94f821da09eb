"""Loss wrappers: input preparation + loss call, per-sequence packed losses, draft loss.

Each is `wrapper(logits, data, global_valid_seqs, global_valid_toks) -> (loss, metrics)`.
"""

# docs/behaviour-reference.md §3.6. That call is the contract `train.LossPostProcessor` binds to
# a microbatch; process groups are passed in explicitly, never read from a global state.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.draft_loss import DraftCrossEntropyLossFn
from lightning_mcore_rl.losses.interfaces import REDUCTION_RULES, LossFunction, MetricNormalizer
from lightning_mcore_rl.losses.loss_input import prepare_loss_input
from lightning_mcore_rl.parallel import host_ints

# ``prepare_fn(logits, data, loss_fn, vocab_parallel_rank, vocab_parallel_group,
# context_parallel_group) -> (loss_input, data)``
PrepareFn = Callable[..., tuple[dict[str, Any], BatchedDataDict]]
LossResult = tuple[Tensor, dict[str, Any]]

_SEQ_METRIC_MIN = frozenset(
    {"probs_ratio_min", "probs_ratio_clamped_min", "opd_full_reverse_kl_min"}
)
"""Metrics combined across packed sequences with ``min`` when the loss declares no normaliser."""
_SEQ_METRIC_MAX = frozenset(
    {"probs_ratio_max", "probs_ratio_clamped_max", "opd_full_reverse_kl_max",
     "opd_full_decomposition_error"}
)  # fmt: skip
"""Metrics combined across packed sequences with ``max`` when the loss declares no normaliser."""


_COMBINE_TENSORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "sum": torch.add,
    "min": torch.minimum,
    "max": torch.maximum,
}


def wrap_loss_fn_with_input_preparation(
    next_token_logits: Tensor,
    data: BatchedDataDict,
    global_valid_seqs: Tensor | float,
    global_valid_toks: Tensor | float,
    loss_fn: LossFunction,
    prepare_fn: PrepareFn = prepare_loss_input,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> LossResult:
    """`loss_fn`'s `(loss, metrics)` on what `prepare_fn` builds from `[B, S/CP, V/TP]` logits."""
    loss_input, data = prepare_fn(
        next_token_logits, data, loss_fn, vocab_parallel_rank, vocab_parallel_group,
        context_parallel_group,
    )  # fmt: skip
    return loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)


class _PackedWrapperBase:
    """Holds the loss, the preparation function, the THD boundaries and the process groups."""

    def __init__(
        self,
        loss_fn: LossFunction,
        prepare_fn: PrepareFn,
        cu_seqlens_q: Tensor | Sequence[int],
        cu_seqlens_q_padded: Tensor | Sequence[int],
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: Any = None,
        context_parallel_group: Any = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.prepare_fn = prepare_fn
        # host ints once: the per-sequence loop must not sync per entry
        self.cu_seqlens_q = host_ints(cu_seqlens_q)
        self.cu_seqlens_q_padded = host_ints(cu_seqlens_q_padded)
        if len(self.cu_seqlens_q) != len(self.cu_seqlens_q_padded):
            raise ValueError(
                f"`cu_seqlens_q` ({len(self.cu_seqlens_q)} entries) and `cu_seqlens_q_padded` "
                f"({len(self.cu_seqlens_q_padded)}) must both have B+1 entries"
            )
        self.vocab_parallel_rank = vocab_parallel_rank
        self.vocab_parallel_group = vocab_parallel_group
        self.context_parallel_group = context_parallel_group

    @property
    def cp_size(self) -> int:
        """`CP` of the context-parallel group (1 without one)."""
        group = self.context_parallel_group
        return 1 if group is None else int(group.size())


def _sequence_spans(logits: Tensor, cu_qp: Sequence[int], cp: int) -> tuple[Tensor, ...]:
    """Views `[1, (cu_qp[i+1] - cu_qp[i])/CP, V/TP]` of each sequence's padded span of the
    packed `logits [1, T/CP, V/TP]`."""
    # ONE `split` (the rest of the row after the last span is a last piece): its backward
    # concatenates the spans' gradients into one logits-sized buffer. A `narrow` per sequence
    # would allocate a zero-filled logits-sized gradient for each sequence and add it into the
    # accumulated one (a third logits-sized buffer at the peak). Values are the same: each
    # position gets exactly one sequence's gradient.
    bounds = [q // cp for q in cu_qp]
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return logits.split([bounds[0], *sizes, logits.shape[1] - bounds[-1]], dim=1)[1:-1]


class SequencePackingLossWrapper(_PackedWrapperBase):
    """Calls the loss once per packed sequence and sums the results (metrics: extrema min/max).

    Args:
        loss_fn: The loss.
        prepare_fn: Per-sequence input preparation (e.g. a `prepare_loss_input` partial).
        cu_seqlens_q: `[B+1]` sequence boundaries.
        cu_seqlens_q_padded: `[B+1]` padded span boundaries.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
    """

    # docs/behaviour-reference.md §3.6. Every loss divides by the *global* counts, so the sum of
    # the per-sequence losses equals the microbatch loss.

    def _combine(self, key: str) -> Callable[[Tensor, Tensor], Tensor]:
        # the loss's declared normaliser wins; the name lists cover losses that declare none
        how = getattr(self.loss_fn, "metric_normalizations", {}).get(key)
        if how is not None:
            return _COMBINE_TENSORS[REDUCTION_RULES[MetricNormalizer(how)].combine]
        if key in _SEQ_METRIC_MIN:
            return torch.minimum
        if key in _SEQ_METRIC_MAX:
            return torch.maximum
        return torch.add

    def __call__(
        self,
        next_token_logits: Tensor,
        data: BatchedDataDict,
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
    ) -> LossResult:
        """`(loss, metrics)` summed over the sequences of `[1, T/CP, V/TP]` packed logits;
        `data` is the unpacked `[B, S, ...]` microbatch."""
        cu_q, cu_qp, cp = self.cu_seqlens_q, self.cu_seqlens_q_padded, self.cp_size
        width = BatchedDataDict(data).sequence_width()
        loss_accum: Tensor | None = None
        metrics: dict[str, Any] = {}
        spans = _sequence_spans(next_token_logits, cu_qp, cp)
        for i in range(len(cu_q) - 1):
            # sequence i: the logits of its padded span [cu_qp[i]/CP, cu_qp[i+1]/CP) (its CP
            # zigzag shard) and data row i truncated to its own length (capped at S)
            length = min(cu_q[i + 1] - cu_q[i], width)
            padded = cu_qp[i + 1] - cu_qp[i]
            if length == 0 or padded == 0:
                continue
            seq_data = BatchedDataDict(data).slice(i, i + 1).truncate_width(length)
            seq_logits = spans[i]
            loss_input, seq_data = self.prepare_fn(
                seq_logits, seq_data, self.loss_fn, self.vocab_parallel_rank,
                self.vocab_parallel_group, self.context_parallel_group,
            )  # fmt: skip
            loss, seq_metrics = self.loss_fn(
                seq_data, global_valid_seqs, global_valid_toks, **loss_input
            )
            loss_accum = loss if loss_accum is None else loss_accum + loss
            for key, value in seq_metrics.items():
                value = torch.as_tensor(value)
                metrics[key] = (
                    value if key not in metrics else self._combine(key)(metrics[key], value)
                )
        if loss_accum is None:  # every sequence empty: a zero loss that keeps the graph
            loss_accum = next_token_logits.sum() * 0.0
        return loss_accum, metrics


class SequencePackingFusionLossWrapper(_PackedWrapperBase):
    """Calls the loss once on the whole packed microbatch, logprobs unpacked to `[B, S-1]`.

    Args:
        loss_fn: A `LOGPROB` loss.
        prepare_fn: `(logits, data, loss_fn, cu_q, cu_qp, tp_rank, tp_group, cp_group)`, e.g.
            `prepare_packed_loss_input` with sampling params / chunk size bound.
        cu_seqlens_q: `[B+1]` sequence boundaries.
        cu_seqlens_q_padded: `[B+1]` padded span boundaries.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
    """

    # docs/behaviour-reference.md §3.4, §3.6: one pass over the packed logits instead of a loop,
    # with the same result as `SequencePackingLossWrapper`.

    def __call__(
        self,
        next_token_logits: Tensor,
        data: BatchedDataDict,
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
    ) -> LossResult:
        """`loss_fn`'s `(loss, metrics)` from `[1, T/CP, V/TP]` packed logits and the
        unpacked `[B, S, ...]` microbatch."""
        loss_input, data = self.prepare_fn(
            next_token_logits, data, self.loss_fn, self.cu_seqlens_q, self.cu_seqlens_q_padded,
            self.vocab_parallel_rank, self.vocab_parallel_group, self.context_parallel_group,
        )  # fmt: skip
        return self.loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)


class DraftLossWrapper:
    """Policy loss plus `loss_weight` times the draft model's soft cross-entropy.

    Args:
        loss_fn: The wrapped policy loss, called as `loss_fn(logits, data, gvs, gvt, **kwargs)`.
        prepare_fn: Input preparation for the draft loss (e.g. `prepare_loss_input`).
        data_dict: The microbatch it is built for (kept; each call uses its own `data`).
        loss_weight: Weight of the draft loss.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
        draft_valid_toks: Divisor of the draft term and metrics (`None`: `global_valid_toks`).
    """

    # docs/behaviour-reference.md §3.6. The reference's signature: `prepare_fn` and `data_dict`
    # are required, by position or by keyword; `data_dict` is kept as `self.data_dict` as there.
    # `draft_valid_toks=1.0` gives raw sums, normalised once later (NeMo RL's
    # `defer_draft_normalization`).

    def __init__(
        self,
        loss_fn: Callable[..., LossResult],
        prepare_fn: PrepareFn,
        data_dict: BatchedDataDict,
        loss_weight: float = 1.0,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: Any = None,
        context_parallel_group: Any = None,
        *,
        draft_valid_toks: float | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.prepare_fn = prepare_fn
        self.data_dict = data_dict
        self.loss_weight = loss_weight
        self.draft_loss_fn = DraftCrossEntropyLossFn()
        self.vocab_parallel_rank = vocab_parallel_rank
        self.vocab_parallel_group = vocab_parallel_group
        self.context_parallel_group = context_parallel_group
        self.draft_valid_toks = draft_valid_toks

    def __call__(
        self,
        next_token_logits: Tensor,
        data: BatchedDataDict,
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float | None,
        **kwargs: Any,
    ) -> LossResult:
        """`(policy_loss + loss_weight * draft_loss, metrics)` from `[B, S/CP, V/TP]` policy
        logits and `data` holding `student_logits [B, S, V_draft]`.

        Raises:
            ValueError: `global_valid_toks` is `None`.
        """
        if global_valid_toks is None:
            raise ValueError(
                "DraftLossWrapper needs `global_valid_toks` to normalise the draft loss"
            )
        loss, metrics = self.loss_fn(
            next_token_logits, data, global_valid_seqs, global_valid_toks, **kwargs
        )
        # The draft input: the policy logits rolled left by one as the teacher, `student_logits`
        # from the data (`LossInputType.DRAFT`). The teacher is detached, so the draft term
        # reaches only the student and the policy's gradient is the wrapped loss's alone.
        draft_input, data = self.prepare_fn(
            next_token_logits, data, self.draft_loss_fn, self.vocab_parallel_rank,
            self.vocab_parallel_group, self.context_parallel_group,
        )  # fmt: skip
        count = global_valid_toks if self.draft_valid_toks is None else self.draft_valid_toks
        draft_loss, _ = self.draft_loss_fn(data, global_valid_seqs, count, **draft_input)
        metrics = dict(metrics)
        metrics["draft_loss"] = draft_loss.detach().clone()
        # each a sum over the scored positions / `count`: a `TOKENS` contribution
        metrics.update(_acceptance_metrics(draft_input, data, count))
        return loss + self.loss_weight * draft_loss, metrics


def _acceptance_metrics(
    draft_input: dict[str, Any], data: BatchedDataDict, count: Any
) -> dict[str, Tensor]:
    """Detached `draft_top1_agreement` and `draft_expected_acceptance` over the draft loss's
    scored positions; `p`/`q` the teacher's/student's softmax, both `[B, S, V]`."""
    with torch.no_grad():
        student, teacher = draft_input["student_logits"], draft_input["teacher_logits"]
        # top-1 agreement: the draft's argmax is the policy's, greedy decoding's acceptance
        same = (student.argmax(-1) == teacher.argmax(-1)).float()  # [B, S]
        p, q = teacher.float().softmax(-1), student.float().softmax(-1)
        # sum_v min(p_v, q_v): the probability that speculative sampling accepts the draft's
        # token (Leviathan et al. 2023, §3.5)
        accept = torch.minimum(p, q).sum(-1)  # [B, S]
        sample_mask = torch.as_tensor(data["sample_mask"]).float().to(same.device)
        # the rolled token mask of the draft input, times the sample mask
        mask = draft_input["token_mask"].float() * sample_mask[:, None]
        denominator = torch.as_tensor(count, dtype=torch.float32).clamp(min=1.0)
        return {
            "draft_top1_agreement": (same * mask).sum() / denominator,
            "draft_expected_acceptance": (accept * mask).sum() / denominator,
        }
