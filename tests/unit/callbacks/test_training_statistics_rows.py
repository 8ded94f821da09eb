"""``TrainingStatistics``' rows without a Trainer run: when a step is logged (Lightning's
``log_every_n_steps`` rule), the tensors it stores, and the pending row sent to the loggers with
or without the timing metrics (the 2-rank fits: ``tests/distributed/strategy/
test_training_statistics.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mcore_rl.callbacks import TrainingStatistics
from lightning_mcore_rl.callbacks.training_statistics import _logged_tensor, _logs_step, _Row
from lightning_mcore_rl.train import StepOutput


def _trainer(**fields: Any) -> Any:
    defaults = {"log_every_n_steps": 1, "fast_dev_run": False, "global_step": 1,
                "should_stop": False, "loggers": []}  # fmt: skip
    return SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize(
    ("fields", "logged"),
    [
        ({}, True),
        ({"log_every_n_steps": 2, "global_step": 1}, False),  # step 0 of every 2nd
        ({"log_every_n_steps": 2, "global_step": 2}, True),  # step 1
        ({"log_every_n_steps": 2, "global_step": 1, "should_stop": True}, True),
        ({"log_every_n_steps": 0}, False),
        ({"log_every_n_steps": 0, "fast_dev_run": 1}, True),
    ],
)
def test_a_step_is_logged_when_lightning_would_log_it(fields: dict[str, Any], logged: bool):
    assert _logs_step(_trainer(**fields)) is logged


def test_logged_values_are_the_tensors_self_log_would_store():
    assert _logged_tensor("train_loss", 1.5).dtype == torch.float32
    assert _logged_tensor("step_time", 0.1).dtype == torch.float64  # not rounded to float32
    loss = torch.tensor([2.0], requires_grad=True)
    stored = _logged_tensor("train_loss", loss)
    assert stored.shape == () and not stored.requires_grad and float(stored) == 2.0
    with pytest.raises(
        ValueError, match=r"`train_x` must be a scalar, got a tensor of shape \(2,\)"
    ):
        _logged_tensor("train_x", torch.zeros(2))


class _Logger:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, metrics))


def test_the_pending_row_goes_out_once_with_its_timing_metrics():
    logger = _Logger()
    trainer = _trainer(loggers=[logger])
    callback = TrainingStatistics()
    output = StepOutput(loss=torch.tensor(1.0), samples=8.0, tokens=100.0)
    values = {"train_loss": _logged_tensor("train_loss", output.loss)}
    callback._pending = _Row(step=4, epoch=0, values=values, output=output)
    callback._log_pending(trainer, 0.5)
    callback._log_pending(trainer, 0.5)  # sent once
    assert logger.calls == [(4, {"train_loss": 1.0, "step_time": 0.5, "tokens_per_sec": 200.0,
                                 "samples_per_sec": 16.0, "epoch": 0})]  # fmt: skip
    callback._pending = _Row(step=5, epoch=1, values=values, output=output)
    callback._log_pending(trainer, None)  # no agreed time (after an exception): no timing
    callback._pending = _Row(step=6, epoch=1, values=values, output=None)  # a skipped step
    callback._log_pending(trainer, 0.5)
    assert logger.calls[1:] == [(5, {"train_loss": 1.0, "epoch": 1}),
                                (6, {"train_loss": 1.0, "epoch": 1})]  # fmt: skip
