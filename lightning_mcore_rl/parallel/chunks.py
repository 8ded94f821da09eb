"""Megatron model chunks as the layers above see them (the one unwrapping helper)."""

from __future__ import annotations

import torch


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The megatron model inside its wrappers (megatron DDP, `Float16Module`), unwrapped repeatedly."""
    # each wrapper holds the wrapped model as `.module`
    inner = getattr(chunk, "module", None)
    while isinstance(inner, torch.nn.Module):
        chunk, inner = inner, getattr(inner, "module", None)
    return chunk


__all__ = ["unwrap_model"]
