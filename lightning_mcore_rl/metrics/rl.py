"""RL evaluation metrics as torchmetrics `Metric`s: pass@k and a standard deviation."""

# Mean reward, mean/max response length and the truncated fraction are torchmetrics' own
# `MeanMetric`/`MaxMetric`. Every metric here takes a `process_group`, the data-parallel group
# (TP/PP ranks of one replica hold the same samples), so its synchronised value equals the value
# on the concatenated samples of all data-parallel ranks.

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def pass_at_k(num_samples: int, num_correct: Tensor, k: int) -> Tensor:
    """Unbiased pass@k `1 - C(n - c, k) / C(n, k)`: `num_correct [P]` -> `[P]` fp64."""
    # Chen et al. 2021 (arXiv:2107.03374) Eq. 1 and Fig. 3: the numerically stable product
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i) instead of the binomials.
    if not 1 <= k <= num_samples:
        raise ValueError(f"`k` must be in [1, n={num_samples}], got {k}")
    c = num_correct.to(torch.float64)
    if bool(((c < 0) | (c > num_samples)).any()):
        raise ValueError(f"`num_correct` must be in [0, {num_samples}], got {num_correct.tolist()}")
    i = torch.arange(1, num_samples + 1, dtype=torch.float64)  # [n]
    # factor (1 - k/i) for i in (n - c, n]; 1 elsewhere. When n - c < k the product hits 0.
    in_range = i[None, :] > (num_samples - c)[:, None]  # [P, n]
    factors = torch.where(
        in_range, 1.0 - k / i[None, :], torch.ones_like(in_range, dtype=torch.float64)
    )
    return 1.0 - factors.prod(dim=1)


class PassAtK(Metric):
    """Mean unbiased pass@k over problems (`pass_at_k`), synchronised over a group.

    Args:
        k: the `k` of pass@k.
        process_group: the data-parallel group (`None`: the world).
    """

    full_state_update = False
    higher_is_better = True
    total: Tensor
    problems: Tensor

    def __init__(self, k: int, process_group: Any | None = None) -> None:
        super().__init__(process_group=process_group)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        self.k = k
        self.add_state(
            "total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "problems", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, correct: Tensor) -> None:
        """Add problems: `correct [P, n]` bool, sample `j` of problem `p` correct."""
        if correct.dim() != 2:
            raise ValueError(
                f"`correct` must be [problems, samples], got shape {tuple(correct.shape)}"
            )
        estimates = pass_at_k(correct.shape[1], correct.sum(dim=1), self.k)
        self.total = self.total + estimates.sum().to(self.total)
        self.problems = self.problems + correct.shape[0]

    def compute(self) -> Tensor:
        """Mean pass@k over all problems seen (0 for none)."""
        return self.total / self.problems.clamp(min=1)


class StandardDeviation(Metric):
    """Population standard deviation of all values seen, synchronised over `process_group`
    (the data-parallel group; `None`: the world)."""

    # States are sums of x and x^2 in fp64: sum-reducible over ranks, and fp64 keeps
    # E[x^2] - E[x]^2 from cancelling badly.

    full_state_update = False
    total: Tensor
    squares: Tensor
    count: Tensor

    def __init__(self, process_group: Any | None = None) -> None:
        super().__init__(process_group=process_group)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("total", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("squares", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("count", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        """Add `values` (any shape)."""
        x = values.detach().to(torch.float64).flatten()
        self.total = self.total + x.sum().to(self.total)
        self.squares = self.squares + (x * x).sum().to(self.squares)
        self.count = self.count + x.numel()

    def compute(self) -> Tensor:
        """`sqrt(E[x^2] - E[x]^2)` (0 for no values)."""
        n = self.count.clamp(min=1)
        mean = self.total / n
        # rounding can leave E[x^2] - E[x]^2 slightly below 0
        return (self.squares / n - mean * mean).clamp(min=0.0).sqrt()
