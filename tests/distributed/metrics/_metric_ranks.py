"""Rank function: the metrics synchronised over a 2-rank gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mcore_rl.metrics import PassAtK, RuleReduction, StandardDeviation


def rank_samples(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``correct [P, n=4]`` and rewards (ranks hold different problem counts)."""
    g = torch.Generator().manual_seed(10 + rank)
    correct = torch.rand(3 + 2 * rank, 4, generator=g) < 0.4
    return correct, torch.rand(5 + rank, generator=g)


def synced(rank: int) -> dict[str, object]:
    correct, rewards = rank_samples(rank)
    group = dist.new_group([0, 1])
    values = {}
    for k in (1, 2, 3):
        metric = PassAtK(k, process_group=group)
        metric.update(correct)
        values[f"pass@{k}"] = float(metric.compute())
    std = StandardDeviation(process_group=group)
    std.update(rewards)
    values["std"] = float(std.compute())
    reduction = RuleReduction(["sum", "min", "max"], process_group=group)
    reduction.update(torch.tensor([float(rank + 1), float(-rank), float(10 * rank)]))
    values["rule"] = reduction.compute().tolist()
    return values
