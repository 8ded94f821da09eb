"""Trainer-free wrapping of megatron model chunks (``Float16Module``, megatron DDP)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The megatron model inside DDP / ``Float16Module`` wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def wrap_chunks(
    chunks: Sequence[torch.nn.Module], *, bf16: bool, ddp_config: Any | None
) -> list[torch.nn.Module]:
    """``Float16Module`` (bf16) and megatron ``DistributedDataParallel`` (when ``ddp_config`` is
    given, i.e. when training) around each chunk, and ``finalize_model_grads`` on the config —
    without it megatron does NO data-parallel gradient reduction."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    wrapped: list[torch.nn.Module] = []
    for chunk in chunks:
        config = chunk.config
        module = Float16Module(config, chunk) if bf16 else chunk
        if ddp_config is not None:
            if any(hasattr(p, "main_grad") for p in chunk.parameters()):
                raise RuntimeError(
                    "The model chunks are already wrapped in megatron DDP by another Trainer; "
                    "build a new LightningModule for each Trainer.fit."
                )
            module = DistributedDataParallel(config, ddp_config, module)
        wrapped.append(module)
    if ddp_config is not None:
        for chunk in chunks:
            cast("TransformerConfig", chunk.config).finalize_model_grads_func = finalize_model_grads
    return wrapped
