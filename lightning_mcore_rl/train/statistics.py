"""Training statistics across microbatches and data-parallel ranks (spec §2.9)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def _materialise(all_mb_metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scalar tensor metrics -> Python floats with ONE host transfer; other values unchanged."""
    scalars = [
        (i, key, value.detach().reshape(()).float())
        for i, metrics in enumerate(all_mb_metrics)
        for key, value in metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    ]
    out = [dict(metrics) for metrics in all_mb_metrics]
    if scalars:
        host = torch.stack([value.cpu() for _, _, value in scalars]).tolist()
        for (i, key, _), value in zip(scalars, host, strict=True):
            out[i][key] = value
    return out


def aggregate_training_statistics(
    all_mb_metrics: list[dict[str, Any]],
    losses: list[float | torch.Tensor],
    data_parallel_group: Any,
) -> tuple[dict[str, list[Any]], torch.Tensor]:
    """Sum the per-gradient-buffer losses over DP and list the metrics per microbatch.

    Exactly one collective: ``all_reduce(global_loss, op=SUM, group=data_parallel_group)``. CP
    ranks hold identical losses, so the reduction is over DP only (spec trap 4).

    Args:
        all_mb_metrics: One metric dict per microbatch (keys may differ between microbatches).
        losses: This rank's per-gradient-buffer scalar losses (floats or 0-d tensors).
        data_parallel_group: The data-parallel process group.

    Returns:
        ``(mb_metrics, global_loss)``: a plain dict mapping each metric name to its values in
        microbatch order (scalar tensors as floats; ``{}`` for no microbatches), and the
        ``[len(losses)]`` fp32 tensor of losses summed over DP.
    """
    with torch.no_grad():
        values = [torch.as_tensor(loss).detach().reshape(()).float() for loss in losses]
        device = values[0].device if values else torch.device("cpu")
        global_loss = torch.stack(values) if values else torch.zeros(0, device=device)
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM, group=data_parallel_group)
    mb_metrics: dict[str, list[Any]] = {}
    for metrics in _materialise(all_mb_metrics):
        for key, value in metrics.items():
            mb_metrics.setdefault(key, []).append(value)
    return mb_metrics, global_loss
