"""Metric combination helpers and enums."""

import math

import pytest
import torch

from lightning_mcore_rl.losses import (
    ClippedPGLossFn,
    DistillationLossFn,
    DPOLossFn,
    DraftCrossEntropyLossFn,
    LossFunction,
    LossInputType,
    MetricNormalizer,
    MseValueLossFn,
    NLLLossFn,
    OPDFullLossFn,
    PreferenceLossFn,
    combine_microbatch_metrics,
    rescale_metrics,
)

NORMS = {
    "loss": MetricNormalizer.TOKENS,
    "acc": MetricNormalizer.SEQUENCES,
    "n": MetricNormalizer.NONE,
    "lo": MetricNormalizer.MIN,
    "hi": MetricNormalizer.MAX,
}


def test_combine_sums_and_extrema() -> None:
    """Sums for TOKENS/SEQUENCES/NONE; min/max for extrema (inf sentinels drop out)."""
    parts = [
        {"loss": torch.tensor(0.25), "acc": 0.5, "n": 2, "lo": 0.7, "hi": 1.3},
        {"loss": 0.5, "acc": 0.25, "n": 1, "lo": math.inf, "hi": -math.inf},
        {"loss": 0.0, "acc": 0.0, "n": 3, "lo": 0.5, "hi": 1.1},
    ]
    out = combine_microbatch_metrics(parts, NORMS)
    assert out == pytest.approx({"loss": 0.75, "acc": 0.75, "n": 6, "lo": 0.5, "hi": 1.3})


def test_rescale_from_placeholder_counts() -> None:
    """Raw sums 6 (tokens) and 3 (sequences) over N_t = 12, N_s = 4 -> 0.5 and 0.75; zero
    counts give 0; NONE and extrema are untouched."""
    summed = {"loss": 6.0, "acc": 3.0, "n": 4.0, "lo": 0.5, "hi": 2.0}
    out = rescale_metrics(summed, NORMS, 4, torch.tensor(12.0))
    assert out == pytest.approx({"loss": 0.5, "acc": 0.75, "n": 4.0, "lo": 0.5, "hi": 2.0})
    assert rescale_metrics(summed, NORMS, 0, 0)["loss"] == 0.0


def test_unknown_metric_raises() -> None:
    """A metric without a declared normaliser is an error naming it."""
    with pytest.raises(ValueError, match="Metric `other` has no entry"):
        combine_microbatch_metrics([{"other": 1.0}], NORMS)


def test_enum_values() -> None:
    """Input types of the issue exist with string values."""
    assert {t.name for t in LossInputType} == {
        "LOGIT",
        "LOGPROB",
        "DISTILLATION",
        "DRAFT",
        "OPD_FULL",
    }
    assert MetricNormalizer("tokens") is MetricNormalizer.TOKENS


@pytest.mark.parametrize(
    "loss_fn",
    [
        ClippedPGLossFn(),
        NLLLossFn(),
        PreferenceLossFn(),
        DPOLossFn(),
        DistillationLossFn(),
        OPDFullLossFn(),
        MseValueLossFn(),
        DraftCrossEntropyLossFn(),
    ],
    ids=lambda f: type(f).__name__,
)
def test_every_loss_satisfies_the_protocol(loss_fn: object) -> None:
    """Every loss exposes loss_type, input_type and metric_normalizations."""
    assert isinstance(loss_fn, LossFunction)
