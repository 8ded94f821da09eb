"""Blocks of rows for the hand-written fp32 backwards of the local spec (`gated_mlp`, `rms_norm`)."""

from __future__ import annotations

import torch

# a block of [rows, width] at a time keeps the temporaries small at the step's peak (the first
# layers' backward, with every activation still held)
CPU_BLOCK = 1 << 20
"""Elements of ``[rows, width]`` per block on CPU: each fp32 temporary 4 MiB."""

DEVICE_BLOCK = 1 << 24
"""Elements per block on an accelerator (64 MiB per fp32 temporary; fewer kernel launches)."""


def row_slices(rows: int, width: int, device: torch.device) -> list[slice]:
    """``[0, rows)`` in blocks of about ``CPU_BLOCK`` (``DEVICE_BLOCK``) elements of ``width``."""
    block = CPU_BLOCK if device.type == "cpu" else DEVICE_BLOCK
    step = max(1, block // max(1, width))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


__all__ = ["CPU_BLOCK", "DEVICE_BLOCK", "row_slices"]
