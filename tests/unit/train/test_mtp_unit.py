"""The MTP helpers of the step: the declared metric reductions, the loss weights ``mask / N_t``,
the metric wrapper's error on a model that recorded no MTP losses, and ``TinyGPTSpec``'s checks."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.extensions.multi_token_prediction import (
    mtp_loss_weights,
    mtp_metric_normalizations,
    with_mtp_metrics,
)
from lightning_mcore_rl.losses import MetricNormalizer
from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.recipes import TinyGPTSpec


def test_metric_normalizations_declare_every_mtp_metric_as_a_token_mean() -> None:
    assert mtp_metric_normalizations(0) == {}
    assert mtp_metric_normalizations(1) == {"mtp_loss": MetricNormalizer.TOKENS}
    assert mtp_metric_normalizations(3) == dict.fromkeys(
        ["mtp_loss", "mtp_1_loss", "mtp_2_loss", "mtp_3_loss"], MetricNormalizer.TOKENS
    )


def test_loss_weights_divide_the_mask_by_the_global_token_count() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    # N_t = 4: each scored token weighs 1/4; no count (forward-only): the mask itself
    assert torch.equal(mtp_loss_weights(mask, torch.tensor(4)), mask / 4)
    assert mtp_loss_weights(mask, None) is mask
    assert mtp_loss_weights(None, torch.tensor(4)) is None
    # an empty global batch (N_t = 0) weighs nothing instead of dividing by zero
    assert torch.equal(mtp_loss_weights(mask, torch.tensor(0)), mask)


def test_metrics_of_a_model_without_recorded_mtp_losses_raise() -> None:
    with pytest.raises(RuntimeError, match="Linear has `mtp_num_layers` set but recorded no"):
        with_mtp_metrics(lambda out: (out, {}), torch.nn.Linear(2, 2), ParallelGroups.single())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mtp_num_layers": -1}, ValueError, "mtp_num_layers must be >= 0 .0: no MTP., got -1"),
        ({"mtp_num_layers": 1.5}, TypeError, "mtp_num_layers must be an int >= 0, got 1.5"),
        ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -0.1}, ValueError,
         "mtp_loss_scaling_factor must be >= 0, got -0.1"),
    ],
)  # fmt: skip
def test_tiny_gpt_spec_rejects_bad_mtp_settings(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TinyGPTSpec(**kwargs)
