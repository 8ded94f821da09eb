"""Validation metrics of sampled completions (torchmetrics, synchronised over data parallel)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics.aggregation import MaxMetric, MeanMetric

from lightning_mcore_rl.metrics import PassAtK, StandardDeviation


class RolloutEvaluation(torch.nn.Module):
    """Reward, pass@k and response-length metrics of ``n`` sampled completions per prompt.

    Each metric is a torchmetrics ``Metric`` over ``process_group`` (the data-parallel group:
    every DP rank scores its own prompts; TP/PP ranks of a replica hold the same samples), so the
    epoch value equals the value on all DP ranks' samples concatenated. Logged as
    ``val_reward``, ``val_reward_std``, ``val_pass@k`` per ``k``, ``val_response_length_mean``,
    ``val_response_length_max``, ``val_truncated_fraction``.

    Args:
        pass_at_k: the ``k`` values (each ``<= n``).
        num_samples: ``n`` completions per prompt.
        process_group: the data-parallel group.
    """

    def __init__(
        self, pass_at_k: Sequence[int], num_samples: int, process_group: Any | None
    ) -> None:
        super().__init__()
        for k in pass_at_k:
            if not 1 <= k <= num_samples:
                raise ValueError(
                    f"pass@k needs 1 <= k <= n (the group size {num_samples}), got k={k}"
                )
        self.num_samples = num_samples
        self.reward = MeanMetric(process_group=process_group)
        self.reward_std = StandardDeviation(process_group=process_group)
        self.pass_at = torch.nn.ModuleDict(
            {str(k): PassAtK(k, process_group=process_group) for k in pass_at_k}
        )
        self.length_mean = MeanMetric(process_group=process_group)
        self.length_max = MaxMetric(process_group=process_group)
        self.truncated = MeanMetric(process_group=process_group)

    def update(self, rewards: Tensor, correct: Tensor, lengths: Tensor, truncated: Tensor) -> None:
        """Add one batch of prompts.

        Args:
            rewards: ``[b*n]`` rewards, group-major (prompt ``p``'s samples are ``p*n .. p*n+n-1``).
            correct: ``[b*n]`` bool, the sample solves its prompt.
            lengths: ``[b*n]`` completion tokens.
            truncated: ``[b*n]`` bool, the completion hit the length limit.
        """
        self.reward.update(rewards)
        self.reward_std.update(rewards)
        for metric in self.pass_at.values():
            cast(PassAtK, metric).update(correct.view(-1, self.num_samples))
        self.length_mean.update(lengths.float())
        self.length_max.update(lengths.float())
        self.truncated.update(truncated.float())

    def log(self, module: LightningModule) -> None:
        """``module.log`` every metric (Lightning computes, synchronises and resets them per
        epoch)."""
        values: dict[str, Any] = {
            "val_reward": self.reward,
            "val_reward_std": self.reward_std,
            "val_response_length_mean": self.length_mean,
            "val_response_length_max": self.length_max,
            "val_truncated_fraction": self.truncated,
        }
        values.update({f"val_pass@{k}": metric for k, metric in self.pass_at.items()})
        for name, metric in values.items():
            module.log(name, metric, on_step=False, on_epoch=True, prog_bar=name == "val_reward")
