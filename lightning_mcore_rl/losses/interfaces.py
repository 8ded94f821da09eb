"""Loss-function protocol, enums and the microbatch-metric combiner.

A loss is called once per microbatch with the *global* counts of the whole optimizer step::

    loss, metrics = loss_fn(data, global_valid_seqs, global_valid_toks, **loss_input)

Every loss divides by those global counts, so summing the per-microbatch losses (and the
per-microbatch metrics declared ``TOKENS``/``SEQUENCES``/``NONE``) over all microbatches and
data-parallel ranks gives the global value, whatever the split
(docs/behaviour-reference.md §2.10, §3.1).
"""

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
    """Which quantities ``prepare_loss_input`` computes from the model output for a loss."""

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
    """How a per-microbatch metric combines into the global-batch metric.

    Losses report ``TOKENS``/``SEQUENCES`` metrics as the microbatch's *contribution* to a
    global mean: ``sum over the microbatch's valid tokens (sequences) / global_valid_toks
    (global_valid_seqs)``. Summing those contributions over microbatches and data-parallel ranks
    therefore gives the global mean. A trainer that ran its microbatches with placeholder counts
    of 1 instead sums the raw values and divides once by the real count
    (:func:`rescale_metrics`).
    """

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
        input_type: Which loss inputs ``prepare_loss_input`` must compute.
        metric_normalizations: For every key of the returned metrics, how it combines across
            microbatches. The keys equal the keys of the metrics dict.
        input_keys: The batch keys the loss (and the preparation of its ``input_type``) reads
            beyond the data contract's ``input_ids`` and ``sample_mask``; the step checks them
            on the host before its first collective
            (:func:`~lightning_mcore_rl.train.validation.loss_input_keys`), and a missing one
            raises naming the key and the loss class. A loss without the attribute declares
            none (its missing keys then fail inside the step).
        token_local_gradient: Optional (read with ``getattr``, default ``False``): ``True``
            declares that the loss's gradient with respect to token ``t``'s logprob depends on
            that token's logprob (and the data) only, never on another token's. The fused LM
            head can then compute its gradients in the forward
            (``LogprobKernelConfig(fused_gradient_in_forward=True)``, no recomputed logits:
            :mod:`~lightning_mcore_rl.ops.fused_linear`); its backward checks the declaration
            and recomputes where it does not hold.
    """

    loss_type: LossType
    input_type: LossInputType
    metric_normalizations: dict[str, MetricNormalizer]

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The batch keys the loss reads (see the class docstring)."""
        ...

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        **loss_input: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Compute one microbatch's loss contribution and metrics.

        Args:
            data: The microbatch (``token_mask [B, S]``, ``sample_mask [B]``, ...).
            global_valid_seqs: Number of valid sequences in the whole global batch.
            global_valid_toks: Number of valid (shifted) tokens in the whole global batch.
            **loss_input: The tensors named by ``input_type``.

        Returns:
            ``(loss, metrics)``: a scalar loss and a dict of detached scalar metrics.
        """
        ...


@dataclass(frozen=True)
class ReductionRule:
    """How metrics of one :class:`MetricNormalizer` combine.

    Attributes:
        combine: across packed sequences, microbatches, pipeline stages and data-parallel ranks
            of one global batch (``sum`` of contributions, or ``min``/``max``).
        across_batches: across the global batches of a validation epoch (each already a
            global-batch value: normalised means average, counts add up).
    """

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
    """Combine per-microbatch metrics into global-batch metrics.

    ``TOKENS``, ``SEQUENCES`` and ``NONE`` metrics are summed, ``MIN`` metrics combined with
    ``min`` and ``MAX`` metrics with ``max`` (the ``±inf`` sentinels of empty microbatches drop
    out). When every microbatch was given the real global counts, the result equals the metrics
    of the whole batch computed at once.

    Args:
        per_microbatch: One metrics dict per microbatch (keys may differ between microbatches).
        metric_normalizations: The loss's ``metric_normalizations``.

    Returns:
        A dict of Python floats, one per key seen in any microbatch.

    Raises:
        ValueError: If a metric has no declared normaliser.
    """
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
    """Turn metrics combined from microbatches run with placeholder counts 1 into global means.

    ``TOKENS`` metrics are divided by ``global_valid_toks``, ``SEQUENCES`` metrics by
    ``global_valid_seqs`` (0 when the count is 0, as ``masked_mean`` gives); the rest is
    unchanged.

    Args:
        summed: Output of :func:`combine_microbatch_metrics`.
        metric_normalizations: The loss's ``metric_normalizations``.
        global_valid_seqs: The real number of valid sequences.
        global_valid_toks: The real number of valid tokens.

    Returns:
        The rescaled metrics.
    """
    seqs, toks = _as_float(global_valid_seqs), _as_float(global_valid_toks)
    out: dict[str, float] = {}
    for key, value in summed.items():
        how = metric_normalizations[key]
        if how is MetricNormalizer.TOKENS:
            out[key] = value / toks if toks else 0.0
        elif how is MetricNormalizer.SEQUENCES:
            out[key] = value / seqs if seqs else 0.0
        else:
            out[key] = value
    return out


def detach_metrics(metrics: Mapping[str, Tensor | float]) -> dict[str, Tensor]:
    """Detach every metric into a 0-dim tensor (no host synchronisation).

    Args:
        metrics: Metric values as tensors or numbers.

    Returns:
        The same keys with detached tensor values.
    """
    return {
        k: v.detach() if isinstance(v, Tensor) else torch.tensor(float(v))
        for k, v in metrics.items()
    }
