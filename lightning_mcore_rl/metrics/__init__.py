"""torchmetrics-based reductions and RL evaluation metrics.

* :class:`RuleReduction` — per-step statistics over the data-parallel group, each entry by its
  rule, in one synchronisation (used by :func:`lightning_mcore_rl.train.reduce_step_statistics`);
  :data:`AGGREGATIONS` — the torchmetrics aggregation of each rule name (validation epochs).
* :class:`PassAtK` (unbiased pass@k), :class:`StandardDeviation` — usable in any
  ``validation_step`` with the data-parallel group; the GRPO recipe's validation uses them with
  torchmetrics' ``MeanMetric``/``MaxMetric``.

Imports only torch and torchmetrics (a bottom layer, like ``ops``).
"""

from lightning_mcore_rl.metrics.reduction import AGGREGATIONS, RuleReduction
from lightning_mcore_rl.metrics.rl import PassAtK, StandardDeviation, pass_at_k

__all__ = ["AGGREGATIONS", "PassAtK", "RuleReduction", "StandardDeviation", "pass_at_k"]
