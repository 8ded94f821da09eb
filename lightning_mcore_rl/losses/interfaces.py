"""Loss-function protocol, enums and the microbatch-metric combiner."""

# A loss is called once per microbatch with the *global* counts of the whole optimizer step,
# `loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)`, and divides by them: so
# summing the per-microbatch losses (and the metrics declared TOKENS/SEQUENCES/NONE) over all
# microbatches and data-parallel ranks gives the global value, whatever the split
# (docs/behaviour-reference.md §2.10, §3.1).

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor


class LossType(str, Enum):
    """Which global count normalises the loss gradient."""

    TOKEN_LEVEL = "token_level"
    """The loss is a sum over valid tokens divided by ``global_valid_toks``."""
    SEQUENCE_LEVEL = "sequence_level"
    """The loss is a sum over valid sequences divided by ``global_valid_seqs``."""


class LossInputType(str, Enum):
    """Which quantities `prepare_loss_input` computes from the model output for a loss."""

    LOGIT = "logit"
    """``logits``: the raw model output (value heads, reward models)."""
    LOGPROB = "logprob"
    """``next_token_logprobs [B, S-1]``: log p(x_{t+1} | x_{<=t})."""
    DISTILLATION = "distillation"
    """``student_topk_logprobs``, ``teacher_topk_logprobs [B, S-1, K]`` and ``H_all [B, S-1]``."""
    DRAFT = "draft"
    """``teacher_logits``, ``student_logits [B, S, V]`` and the rolled ``token_mask [B, S]``."""
    OPD_FULL = "opd_full"
    """``opd_full_divergence [B, S-1]`` (+ optional entropy/cross-entropy/next-token logprobs)."""


class MetricNormalizer(str, Enum):
    """How a per-microbatch metric combines into the global-batch metric."""

    # TOKENS/SEQUENCES metrics are the microbatch's *contribution* to a global mean (a sum over
    # its valid tokens/sequences / the global count), so summing them over microbatches and
    # data-parallel ranks gives the global mean. A trainer that ran its microbatches with
    # placeholder counts of 1 sums the raw values and divides once by the real count
    # (`rescale_metrics`).

    TOKENS = "tokens"
    """Divided by ``global_valid_toks``; combine by summing."""
    SEQUENCES = "sequences"
    """Divided by ``global_valid_seqs``; combine by summing."""
    NONE = "none"
    """Raw counts (e.g. ``num_valid_samples``); combine by summing, never rescale."""
    MIN = "min"
    """A minimum over the microbatch's valid entries (``+inf`` if none); combine with ``min``."""
    MAX = "max"
    """A maximum over the microbatch's valid entries (``-inf`` if none); combine with ``max``."""


@runtime_checkable
class LossFunction(Protocol):
    """What the training step needs from a loss.

    Attributes:
        loss_type: Which global count the loss is normalised by.
        input_type: Which loss inputs `prepare_loss_input` must compute.
        metric_normalizations: How each key of the returned metrics combines across microbatches.
        input_keys: The batch keys read beyond the data contract's `input_ids` and `sample_mask`.
        token_local_gradient: Optional (`getattr`, default `False`): token `t`'s gradient
            depends on token `t`'s logprob (and the data) only.
    """

    # `input_keys` (of the loss and of the preparation of its `input_type`) are checked on the
    # host before the step's first collective (`train.validation.loss_input_keys`): a missing
    # one raises naming the key and the loss class, not a hang. A loss without the attribute
    # declares none; its missing keys then fail inside the step.
    # `token_local_gradient=True` lets the fused LM head compute its gradients in the forward
    # (`LogprobKernelConfig(fused_gradient_in_forward=True)`, no recomputed logits:
    # `ops.fused_linear`); its backward checks the declaration and recomputes where it fails.
    loss_type: LossType
    input_type: LossInputType
    metric_normalizations: dict[str, MetricNormalizer]

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The batch keys the loss reads beyond `input_ids` and `sample_mask`."""
        ...

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **loss_input: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One microbatch's scalar loss contribution and detached scalar metrics.

        `data` holds `token_mask [B, S]`, `sample_mask [B]`, ...; `loss_input` the tensors
        named by `input_type`; the counts are those of the whole global batch (shifted tokens).
        """
        ...


@dataclass(frozen=True)
class ReductionRule:
    """How metrics of one `MetricNormalizer` combine.

    Attributes:
        combine: across packed sequences, microbatches, pipeline stages and DP ranks of a batch.
        across_batches: across the global batches of a validation epoch.
    """

    # across_batches: each batch's value is already a global-batch value, so normalised means
    # average and counts add up.

    combine: Literal["sum", "min", "max"]
    across_batches: Literal["mean", "sum", "min", "max"]


REDUCTION_RULES: dict[MetricNormalizer, ReductionRule] = {
    MetricNormalizer.TOKENS: ReductionRule(combine="sum", across_batches="mean"),
    MetricNormalizer.SEQUENCES: ReductionRule(combine="sum", across_batches="mean"),
    MetricNormalizer.NONE: ReductionRule(combine="sum", across_batches="sum"),
    MetricNormalizer.MIN: ReductionRule(combine="min", across_batches="min"),
    MetricNormalizer.MAX: ReductionRule(combine="max", across_batches="max"),
}
"""The one rule table every reduction of loss metrics in the package follows."""

MEAN_RULE = ReductionRule(combine="sum", across_batches="mean")
"""Rule of a per-microbatch mean (the LM path's loss, divided by the count after the sum)."""


def _as_float(value: Tensor | float) -> float:
    return float(value.detach().item()) if isinstance(value, Tensor) else float(value)


def combine_microbatch_metrics(
    per_microbatch: Sequence[Mapping[str, Tensor | float]],
    metric_normalizations: Mapping[str, MetricNormalizer],
) -> dict[str, float]:
    """Global-batch metrics (floats, one per key seen) from per-microbatch metrics dicts.

    Raises:
        ValueError: a metric has no declared normaliser.
    """
    # Sum, or min/max for MIN/MAX (the ±inf sentinels of empty microbatches drop out). With the
    # real global counts given to every microbatch, this equals the whole batch at once.
    combined: dict[str, float] = {}
    for metrics in per_microbatch:
        for key, value in metrics.items():
            if key not in metric_normalizations:
                raise ValueError(
                    f"Metric `{key}` has no entry in `metric_normalizations` "
                    f"(known: {sorted(metric_normalizations)})."
                )
            combine = REDUCTION_RULES[MetricNormalizer(metric_normalizations[key])].combine
            x = _as_float(value)
            if key not in combined:
                combined[key] = x
            else:
                combined[key] = _COMBINE_FLOATS[combine](combined[key], x)
    return combined


_COMBINE_FLOATS: dict[str, Callable[[float, float], float]] = {
    "sum": lambda a, b: a + b,
    "min": min,
    "max": max,
}


def rescale_metrics(
    summed: Mapping[str, float],
    metric_normalizations: Mapping[str, MetricNormalizer],
    global_valid_seqs: Tensor | float,
    global_valid_toks: Tensor | float,
) -> dict[str, float]:
    """Global means of `combine_microbatch_metrics` output from microbatches run with
    placeholder counts 1: TOKENS / `global_valid_toks`, SEQUENCES / `global_valid_seqs`."""
    seqs, toks = _as_float(global_valid_seqs), _as_float(global_valid_toks)
    out: dict[str, float] = {}
    for key, value in summed.items():
        how = metric_normalizations[key]
        if how is MetricNormalizer.TOKENS:
            # 0 for a count of 0, as `masked_mean` gives
            out[key] = value / toks if toks else 0.0
        elif how is MetricNormalizer.SEQUENCES:
            out[key] = value / seqs if seqs else 0.0
        else:
            out[key] = value
    return out


def detach_metrics(metrics: Mapping[str, Tensor | float]) -> dict[str, Tensor]:
    """The same keys, each value a detached 0-dim tensor."""
    # no `.item()`: a host synchronisation per metric per microbatch would stall the GPU
    return {
        k: v.detach() if isinstance(v, Tensor) else torch.tensor(float(v))
        for k, v in metrics.items()
    }
