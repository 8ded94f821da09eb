"""torchmetrics-based reductions and RL evaluation metrics.

* :class:`RuleReduction` — a vector of statistics over a process group, each entry by its
  rule, in one synchronisation; :func:`combine_rows` — the same rules on rows already gathered
  (used by :func:`lightning_mcore_rl.train.reduce_step_statistics` on its all-gather);
  :data:`AGGREGATIONS` — the torchmetrics aggregation of each rule name (validation epochs).
* :class:`PassAtK` (unbiased pass@k), :class:`StandardDeviation` — usable in any
  ``validation_step`` with the data-parallel group; the GRPO recipe's validation uses them with
  torchmetrics' ``MeanMetric``/``MaxMetric``.

Imports only torch and torchmetrics (a bottom layer, like ``ops``).
"""

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
