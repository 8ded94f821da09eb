"""The step's ONE agreement collective: every rank's input verdict and batch summary, all-gathered.

Each rank contributes ``[verdict, replica, rows, width, fingerprint]`` (int64, ``replica`` = its
data-parallel rank: the tensor/context/pipeline-parallel ranks of one model replica share it).
From the gathered ``[world, 5]`` table every rank derives the same decision:

* the MAX verdict (:data:`OK` / :data:`NONFINITE` / :data:`INVALID`) — the non-finite policy;
* when no rank rejected its batch: every rank holds the same number of rows (one global batch,
  split evenly over data parallelism: unequal shares stall megatron's schedule or the statistics'
  all-gather) and the ranks of one replica hold the same batch (width and
  :func:`~lightning_mcore_rl.train.validation.batch_fingerprint`: TP peers given different data
  would silently train on a mix). A mismatch raises :class:`BatchMismatchError` on every rank,
  before the model runs, naming the ranks and what differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

OK, NONFINITE, INVALID = 0, 1, 2
"""Input verdict codes, combined over ranks by MAX."""

_VERDICT, _REPLICA, _ROWS, _WIDTH, _FINGERPRINT = range(5)


class BatchMismatchError(ValueError):
    """The ranks hold batches that cannot form one step (raised on every rank alike)."""


@dataclass(frozen=True)
class RankInput:
    """One rank's entry of the agreement table.

    Attributes:
        verdict: :data:`OK`, :data:`NONFINITE` or :data:`INVALID`.
        replica: the rank's data-parallel rank (its model replica).
        rows: ``B`` (0 when the batch was rejected).
        width: ``S`` (0 when the batch was rejected).
        fingerprint: the batch's fingerprint (0 when the batch was rejected).
    """

    verdict: int
    replica: int
    rows: int = 0
    width: int = 0
    fingerprint: int = 0


def gather_inputs(entry: RankInput, device: torch.device | str, group: Any) -> torch.Tensor:
    """The ONE collective: ``entry`` of every rank of ``group`` (None: the default group) as a
    ``[world, 5]`` int64 table on the CPU, in group-rank order (one rank: its own row)."""
    local = torch.tensor(
        [entry.verdict, entry.replica, entry.rows, entry.width, entry.fingerprint],
        dtype=torch.int64,
        device=device,
    )
    if not (dist.is_available() and dist.is_initialized()):
        return local[None].cpu()
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, local, group=group)
    return torch.stack(rows).cpu()


def agreed_verdict(table: torch.Tensor) -> int:
    """The MAX verdict over the ranks, after :func:`check_agreement` when no rank rejected.

    Raises:
        BatchMismatchError: see :func:`check_agreement`.
    """
    verdict = int(table[:, _VERDICT].max())
    if verdict != INVALID:
        check_agreement(table)
    return verdict


def check_agreement(table: torch.Tensor) -> None:
    """Equal row counts on every rank, and equal width and fingerprint within each replica.

    Args:
        table: ``[world, 5]`` from :func:`gather_inputs` (row ``r``: group rank ``r``).

    Raises:
        BatchMismatchError: naming the ranks and their rows, widths or fingerprints.
    """
    rows = [int(n) for n in table[:, _ROWS]]
    if len(set(rows)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows))
        raise BatchMismatchError(
            f"The ranks hold different numbers of rows ({listing}): each data-parallel rank "
            "must hold an equal share of the global batch (global batch / DP rows, the same on "
            "its tensor/context/pipeline-parallel ranks). Shard the data with a "
            "DistributedSampler over the data-parallel ranks and equal batch sizes."
        )
    for replica in sorted({int(r) for r in table[:, _REPLICA]}):
        ranks = [r for r in range(len(table)) if int(table[r, _REPLICA]) == replica]
        for column, what in ((_WIDTH, "widths S"), (_FINGERPRINT, "contents (fingerprints)")):
            values = [int(table[r, column]) for r in ranks]
            if len(set(values)) > 1:
                shown = ", ".join(
                    f"rank {r}: {v:#x}" if column == _FINGERPRINT else f"rank {r}: {v}"
                    for r, v in zip(ranks, values, strict=True)
                )
                raise BatchMismatchError(
                    f"The ranks {ranks} of model replica {replica} (data-parallel rank "
                    f"{replica}: its tensor/context/pipeline-parallel ranks) hold batches of "
                    f"different {what} ({shown}); they must hold the same batch. Give every "
                    "rank of a replica the same data: shard over the data-parallel ranks "
                    "(`DistributedSampler(num_replicas=dp_size, rank=dp_rank)`, as the "
                    "strategy's sampler does), not over all ranks."
                )


__all__ = [
    "INVALID",
    "NONFINITE",
    "OK",
    "BatchMismatchError",
    "RankInput",
    "agreed_verdict",
    "check_agreement",
    "gather_inputs",
]
