"""The Lightning ``Trainer`` of the tests: quiet and on this process's ranks."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import Trainer


def cpu_trainer(**overrides: Any) -> Trainer:
    """A CPU ``Trainer`` over every rank of ``WORLD_SIZE`` (1 outside ``run_on_ranks``) with no
    logger, checkpointing, progress bar or model summary; ``overrides`` replace any of these."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": int(os.environ.get("WORLD_SIZE", "1")),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return Trainer(**{**options, **overrides})
