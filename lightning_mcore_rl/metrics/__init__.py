"""torchmetrics-based rule reductions and RL evaluation metrics (pass@k, standard deviation)."""

# A bottom layer like `ops`: imports only torch and torchmetrics.
# `combine_rows` serves `lightning_mcore_rl.train.reduce_step_statistics` on its own all-gather;
# the GRPO recipe's validation uses `PassAtK`/`StandardDeviation` with `MeanMetric`/`MaxMetric`.

from lightning_mcore_rl.metrics.reduction import AGGREGATIONS, RuleReduction, combine_rows
from lightning_mcore_rl.metrics.rl import PassAtK, StandardDeviation, pass_at_k

__all__ = [
    "AGGREGATIONS",
    "PassAtK",
    "RuleReduction",
    "StandardDeviation",
    "combine_rows",
    "pass_at_k",
]
