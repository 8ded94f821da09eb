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
    """Reward, pass@k (each ``k <= num_samples``) and response-length metrics of ``num_samples``
    completions per prompt, synchronised over ``process_group`` (the DP group)."""

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
        # Each metric synchronises over the DP group (every DP rank scores its own prompts; a
        # replica's TP/PP ranks hold the same samples): the epoch value is that of all DP ranks'
        # samples concatenated.
        self.reward = MeanMetric(process_group=process_group)
        self.reward_std = StandardDeviation(process_group=process_group)
        self.pass_at = torch.nn.ModuleDict(
            {str(k): PassAtK(k, process_group=process_group) for k in pass_at_k}
        )
        self.length_mean = MeanMetric(process_group=process_group)
        self.length_max = MaxMetric(process_group=process_group)
        self.truncated = MeanMetric(process_group=process_group)

    def update(self, rewards: Tensor, correct: Tensor, lengths: Tensor, truncated: Tensor) -> None:
        """Add one batch: ``rewards``, bool ``correct``, ``lengths``, bool ``truncated``, each
        ``[b*n]`` group-major (prompt ``p``'s samples are ``p*n .. p*n+n-1``)."""
        self.reward.update(rewards)
        self.reward_std.update(rewards)
        for metric in self.pass_at.values():
            # [b, n]: pass@k of each prompt over its n samples
            cast(PassAtK, metric).update(correct.view(-1, self.num_samples))
        self.length_mean.update(lengths.float())
        self.length_max.update(lengths.float())
        self.truncated.update(truncated.float())

    def log(self, module: LightningModule) -> None:
        """``module.log`` every metric (Lightning syncs and resets them per epoch)."""
        # val_pass@k per k, the others by name
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
