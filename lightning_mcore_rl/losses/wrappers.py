"""Loss wrappers: input preparation + loss call, per-sequence packed losses, draft loss.

Behaviour: docs/behaviour-reference.md §3.6.

Every wrapper is called as ``wrapper(logits, data, global_valid_seqs, global_valid_toks) ->
(loss, metrics)``, the contract ``train.LossPostProcessor`` binds to a microbatch. Process groups
are passed in explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.draft import DraftCrossEntropyLossFn
from lightning_mcore_rl.losses.interfaces import REDUCTION_RULES, LossFunction, MetricNormalizer
from lightning_mcore_rl.losses.loss_input import prepare_loss_input

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


def _as_ints(values: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


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
    """Prepare the loss input from the logits, then call the loss once on the microbatch.

    Args:
        next_token_logits: ``[B, S/CP, V_l]`` model output.
        data: The microbatch.
        global_valid_seqs: Valid sequences of the global batch.
        global_valid_toks: Valid (shifted) tokens of the global batch.
        loss_fn: The loss.
        prepare_fn: Input preparation (default :func:`prepare_loss_input`).
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.

    Returns:
        ``(loss, metrics)`` of ``loss_fn``.
    """
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
        self.cu_seqlens_q = _as_ints(cu_seqlens_q)
        self.cu_seqlens_q_padded = _as_ints(cu_seqlens_q_padded)
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
        """``CP`` of the context-parallel group (1 without one)."""
        group = self.context_parallel_group
        return 1 if group is None else int(group.size())


def _sequence_spans(logits: Tensor, cu_qp: Sequence[int], cp: int) -> tuple[Tensor, ...]:
    """Views ``[1, (cu_qp[i+1] - cu_qp[i])/CP, V_l]`` of each sequence's padded span of the
    packed ``logits [1, T/CP, V_l]``, from ONE ``split`` (the rest of the row after the last
    span is a last piece). Its backward concatenates the spans' gradients into one logits-sized
    buffer; a ``narrow`` per sequence would instead allocate a zero-filled logits-sized gradient
    for each sequence and add it into the accumulated one (a third logits-sized buffer at the
    peak). The values are the same: each position gets exactly one sequence's gradient."""
    bounds = [q // cp for q in cu_qp]
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return logits.split([bounds[0], *sizes, logits.shape[1] - bounds[-1]], dim=1)[1:-1]


class SequencePackingLossWrapper(_PackedWrapperBase):
    """Calls the loss once per packed sequence and sums the results.

    See docs/behaviour-reference.md §3.6.

    Sequence ``i`` uses the logits of its padded span ``[cu_qp[i]/CP, cu_qp[i+1]/CP)`` (its CP
    zigzag shard) and the data row ``i`` truncated to ``len_i = cu_q[i+1] - cu_q[i]`` tokens
    (capped at ``S``). Because every loss divides by the *global* counts, the sum of the
    per-sequence losses equals the microbatch loss. Metrics are summed, except extrema
    (``MIN``/``MAX`` normalisers, or the names in ``_SEQ_METRIC_MIN/_MAX``), which use min/max.

    Args:
        loss_fn: The loss.
        prepare_fn: Per-sequence input preparation (e.g. :func:`prepare_loss_input` partial).
        cu_seqlens_q: ``[B+1]`` sequence boundaries.
        cu_seqlens_q_padded: ``[B+1]`` padded span boundaries.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
    """

    def _combine(self, key: str) -> Callable[[Tensor, Tensor], Tensor]:
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
        """Sum the loss over the packed sequences.

        Args:
            next_token_logits: ``[1, T/CP, V_l]`` packed logits.
            data: The unpacked microbatch ``[B, S, ...]``.
            global_valid_seqs: Valid sequences of the global batch.
            global_valid_toks: Valid tokens of the global batch.

        Returns:
            ``(loss, metrics)`` summed (extrema: min/max) over sequences.
        """
        cu_q, cu_qp, cp = self.cu_seqlens_q, self.cu_seqlens_q_padded, self.cp_size
        width = BatchedDataDict(data).sequence_width()
        loss_accum: Tensor | None = None
        metrics: dict[str, Any] = {}
        spans = _sequence_spans(next_token_logits, cu_qp, cp)
        for i in range(len(cu_q) - 1):
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
    """Calls the loss once on the whole packed microbatch.

    See docs/behaviour-reference.md §3.4, §3.6.

    ``prepare_fn`` (:func:`~lightning_mcore_rl.losses.loss_input.prepare_packed_loss_input`
    with sampling params / chunk size bound) unpacks the packed logprobs to ``[B, S-1]`` in one
    pass; the result equals :class:`SequencePackingLossWrapper`'s.

    Args:
        loss_fn: A ``LOGPROB`` loss.
        prepare_fn: ``prepare_fn(logits, data, loss_fn, cu_q, cu_qp, tp_rank, tp_group,
            cp_group) -> (loss_input, data)``.
        cu_seqlens_q: ``[B+1]`` sequence boundaries.
        cu_seqlens_q_padded: ``[B+1]`` padded span boundaries.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
    """

    def __call__(
        self,
        next_token_logits: Tensor,
        data: BatchedDataDict,
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
    ) -> LossResult:
        """Prepare the packed loss input once and call the loss.

        Args:
            next_token_logits: ``[1, T/CP, V_l]`` packed logits.
            data: The unpacked microbatch ``[B, S, ...]``.
            global_valid_seqs: Valid sequences of the global batch.
            global_valid_toks: Valid tokens of the global batch.

        Returns:
            ``(loss, metrics)`` of ``loss_fn``.
        """
        loss_input, data = self.prepare_fn(
            next_token_logits, data, self.loss_fn, self.cu_seqlens_q, self.cu_seqlens_q_padded,
            self.vocab_parallel_rank, self.vocab_parallel_group, self.context_parallel_group,
        )  # fmt: skip
        return self.loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)


class DraftLossWrapper:
    """Policy loss plus ``loss_weight`` times the draft model's soft cross-entropy.

    See docs/behaviour-reference.md §3.6. The reference's signature: ``prepare_fn`` and
    ``data_dict`` are required, by position or by keyword.

    The draft input (policy logits rolled left by one as the teacher, ``student_logits`` from the
    data) is built by ``prepare_fn`` for a :class:`DraftCrossEntropyLossFn`
    (``LossInputType.DRAFT``). The draft term reaches only the student: the teacher is detached,
    so the policy's gradient is the wrapped loss's alone.

    Metrics added, each ``sum over scored positions / draft_valid_toks`` (a ``TOKENS``
    contribution): ``draft_loss`` (the soft cross entropy), ``draft_top1_agreement`` (the
    draft's argmax is the policy's: greedy decoding's acceptance) and
    ``draft_expected_acceptance`` (``sum_v min(p_v, q_v)`` of the policy's ``p`` and the draft's
    ``q``: the probability that speculative sampling accepts the draft's token, Leviathan et al.
    2023, §3.5).

    Args:
        loss_fn: The wrapped policy loss, called as ``loss_fn(logits, data, gvs, gvt, **kwargs)``.
        prepare_fn: Input preparation for the draft loss (e.g. :func:`prepare_loss_input`).
        data_dict: The microbatch the wrapper is built for, kept as ``self.data_dict`` as in the
            reference; each call uses its own ``data`` argument.
        loss_weight: Weight of the draft loss.
        vocab_parallel_rank: TP rank.
        vocab_parallel_group: TP group.
        context_parallel_group: CP group.
        draft_valid_toks: The count the draft term and its metrics are divided by (``None``: the
            call's ``global_valid_toks``; ``1.0``: raw sums, normalised once later, NeMo RL's
            ``defer_draft_normalization``).
    """

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
        """Policy loss + weighted draft loss; adds the ``draft_loss`` and
        ``draft_top1_agreement`` metrics.

        Args:
            next_token_logits: ``[B, S/CP, V_l]`` policy logits.
            data: The microbatch, with ``student_logits [B, S, V_draft]``.
            global_valid_seqs: Valid sequences of the global batch.
            global_valid_toks: Valid tokens of the global batch (required).
            **kwargs: Passed on to ``loss_fn``.

        Returns:
            ``(policy_loss + loss_weight * draft_loss, metrics)``.

        Raises:
            ValueError: ``global_valid_toks`` is ``None``.
        """
        if global_valid_toks is None:
            raise ValueError(
                "DraftLossWrapper needs `global_valid_toks` to normalise the draft loss"
            )
        loss, metrics = self.loss_fn(
            next_token_logits, data, global_valid_seqs, global_valid_toks, **kwargs
        )
        draft_input, data = self.prepare_fn(
            next_token_logits, data, self.draft_loss_fn, self.vocab_parallel_rank,
            self.vocab_parallel_group, self.context_parallel_group,
        )  # fmt: skip
        count = global_valid_toks if self.draft_valid_toks is None else self.draft_valid_toks
        draft_loss, _ = self.draft_loss_fn(data, global_valid_seqs, count, **draft_input)
        metrics = dict(metrics)
        metrics["draft_loss"] = draft_loss.detach().clone()
        metrics.update(_acceptance_metrics(draft_input, data, count))
        return loss + self.loss_weight * draft_loss, metrics


def _acceptance_metrics(
    draft_input: dict[str, Any], data: BatchedDataDict, count: Any
) -> dict[str, Tensor]:
    """``draft_top1_agreement = sum_t m_t [argmax q_t = argmax p_t] / count`` and
    ``draft_expected_acceptance = sum_t m_t sum_v min(p_tv, q_tv) / count`` over the draft
    loss's scored positions (``m`` = rolled token mask x sample mask; ``p`` the teacher's softmax,
    ``q`` the student's, both ``[B, S, V]``), detached."""
    with torch.no_grad():
        student, teacher = draft_input["student_logits"], draft_input["teacher_logits"]
        same = (student.argmax(-1) == teacher.argmax(-1)).float()  # [B, S]
        p, q = teacher.float().softmax(-1), student.float().softmax(-1)
        accept = torch.minimum(p, q).sum(-1)  # [B, S]
        sample_mask = torch.as_tensor(data["sample_mask"]).float().to(same.device)
        mask = draft_input["token_mask"].float() * sample_mask[:, None]
        denominator = torch.as_tensor(count, dtype=torch.float32).clamp(min=1.0)
        return {
            "draft_top1_agreement": (same * mask).sum() / denominator,
            "draft_expected_acceptance": (accept * mask).sum() / denominator,
        }
