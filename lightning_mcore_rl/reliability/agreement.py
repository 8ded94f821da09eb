"""The step's ONE agreement collective: every rank's input verdict and batch summary, all-gathered.

Each rank contributes ``[verdict, replica, rows, width, fingerprint, signal, step_time_ns]``
(int64, ``replica`` = its data-parallel rank: the tensor/context/pipeline-parallel ranks of one
model replica share it). From the gathered ``[world, 7]`` table every rank derives the same
decision:

* the MAX verdict (:data:`OK` / :data:`NONFINITE` / :data:`INVALID`) — the non-finite policy;
* when no rank rejected its batch: every rank holds the same number of rows (one global batch,
  split evenly over data parallelism: unequal shares stall megatron's schedule or the statistics'
  all-gather) and the ranks of one replica hold the same batch (width and
  :func:`~lightning_mcore_rl.train.validation.batch_fingerprint`: TP peers given different data
  would silently train on a mix). A mismatch raises :class:`BatchMismatchError` on every rank,
  before the model runs, naming the ranks and what differs.

The same collective carries what a training step must agree on at its start
(:class:`StepBoundary`, filled in the first pass of each training step only, 0 elsewhere): the
MAX ``signal`` (a SIGTERM any rank received, acted on by every rank at this point:
:class:`~lightning_mcore_rl.reliability.signals.TerminationRequest`) and the MAX ``step_time_ns``
(the previous training step's wall time, the slowest rank's: ``step_time``, logged one step
late). So a training step runs one world-group collective before its model runs, not three.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_mcore_rl.reliability.signals import TerminationRequest

OK, NONFINITE, INVALID = 0, 1, 2
"""Input verdict codes, combined over ranks by MAX."""

_VERDICT, _REPLICA, _ROWS, _WIDTH, _FINGERPRINT, _SIGNAL, _STEP_TIME = range(7)


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
        signal: a terminating signal this rank received (0: none; :class:`StepBoundary`).
        step_time_ns: this rank's previous training step, ns (0: none; :class:`StepBoundary`).
    """

    verdict: int
    replica: int
    rows: int = 0
    width: int = 0
    fingerprint: int = 0
    signal: int = 0
    step_time_ns: int = 0


def gather_inputs(entry: RankInput, device: torch.device | str, group: Any) -> torch.Tensor:
    """The ONE collective: ``entry`` of every rank of ``group`` (None: the default group) as a
    ``[world, 7]`` int64 table on the CPU, in group-rank order (one rank: its own row)."""
    local = torch.tensor(
        [entry.verdict, entry.replica, entry.rows, entry.width, entry.fingerprint,
         entry.signal, entry.step_time_ns],
        dtype=torch.int64,
        device=device,
    )  # fmt: skip
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
    verdict = max(row[_VERDICT] for row in table.tolist())
    if verdict != INVALID:
        check_agreement(table)
    return verdict


def rejected_ranks(table: torch.Tensor) -> list[int]:
    """The group ranks of the gathered ``table`` that rejected their batch (:data:`INVALID`)."""
    return [r for r, entry in enumerate(table.tolist()) if entry[_VERDICT] == INVALID]


def gather_rejections(error: BaseException | None, group: Any) -> dict[int, str]:
    """Collective over ``group`` (None: the default group; every rank calls it, once the
    agreement showed that some ranks rejected their batch and others did not, so it costs
    nothing on a good step, nor when every rank raises its own error):
    ``{global rank: "ValueError: <first line>"}`` of the ranks whose ``error`` is not None."""
    reason = None if error is None else f"{type(error).__name__}: {_first_line(error)}"
    if not (dist.is_available() and dist.is_initialized()):
        return {} if reason is None else {0: reason}
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    ranks = range(len(reasons)) if group is None else dist.get_process_group_ranks(group)
    return {rank: r for rank, r in zip(ranks, reasons, strict=True) if r is not None}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def check_agreement(table: torch.Tensor) -> None:
    """Equal row counts on every rank, and equal width and fingerprint within each replica.

    Args:
        table: ``[world, 7]`` from :func:`gather_inputs` (row ``r``: group rank ``r``).

    Raises:
        BatchMismatchError: naming the ranks and their rows, widths or fingerprints.
    """
    entries: list[list[int]] = table.tolist()  # one host read, then plain ints
    rows = [entry[_ROWS] for entry in entries]
    if len(set(rows)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows))
        raise BatchMismatchError(
            f"The ranks hold different numbers of rows ({listing}): each data-parallel rank "
            "must hold an equal share of the global batch (global batch / DP rows, the same on "
            "its tensor/context/pipeline-parallel ranks). Shard the data with a "
            "DistributedSampler over the data-parallel ranks and equal batch sizes."
        )
    _check_replicas(entries, ((_WIDTH, "widths S"), (_FINGERPRINT, "contents (fingerprints)")))


def check_replica_agreement(table: torch.Tensor, where: str = "") -> None:
    """The same batch on the ranks of each model replica (rows, width and fingerprint); the
    replicas may hold different row counts. What a rollout needs before its first collective
    (its TP/PP ranks run the same generation), checked by
    :func:`~lightning_mcore_rl.rollout.preflight.check_before_rollout`.

    Args:
        table: ``[world, 7]`` from :func:`gather_inputs` (row ``r``: group rank ``r``).
        where: the message's head (e.g. ``"Before the rollout: "``).

    Raises:
        BatchMismatchError: naming the replica's ranks and their rows, widths or fingerprints.
    """
    entries: list[list[int]] = table.tolist()
    _check_replicas(
        entries,
        ((_ROWS, "numbers of rows"), (_WIDTH, "widths S"),
         (_FINGERPRINT, "contents (fingerprints)")),
        where,
    )  # fmt: skip


def _check_replicas(
    entries: list[list[int]], columns: tuple[tuple[int, str], ...], where: str = ""
) -> None:
    """Equal ``columns`` (index, what) on the ranks of each replica, else
    :class:`BatchMismatchError` (its message headed by ``where``)."""
    for replica in sorted({entry[_REPLICA] for entry in entries}):
        ranks = [r for r, entry in enumerate(entries) if entry[_REPLICA] == replica]
        for column, what in columns:
            values = [entries[r][column] for r in ranks]
            if len(set(values)) > 1:
                shown = ", ".join(
                    f"rank {r}: {v:#x}" if column == _FINGERPRINT else f"rank {r}: {v}"
                    for r, v in zip(ranks, values, strict=True)
                )
                raise BatchMismatchError(
                    f"{where}The ranks {ranks} of model replica {replica} (data-parallel rank "
                    f"{replica}: its tensor/context/pipeline-parallel ranks) hold batches of "
                    f"different {what} ({shown}); they must hold the same batch. Give every "
                    "rank of a replica the same data: shard over the data-parallel ranks "
                    "(`DistributedSampler(num_replicas=dp_size, rank=dp_rank)`, as the "
                    "strategy's sampler does), not over all ranks."
                )


class StepBoundary:
    """What a training step agrees on at its start, carried by its first agreement collective.

    The strategy calls :meth:`open` at every training batch start and :meth:`stop` after the
    step's optimizer step. The first pass of the step then adds this rank's received signal and
    its previous step's wall time to its :class:`RankInput` (:meth:`stamp`) and, once the table
    is gathered, :meth:`settle` makes every rank act on the same signal (the
    ``termination`` request calls Lightning's handler, on every rank at once) and holds the same
    :attr:`previous_step_time`. Later passes of the step, and passes outside training steps
    (validation, ``trainer.validate``), carry zeros and settle nothing.

    Args:
        termination: the strategy's SIGTERM request.
    """

    def __init__(self, termination: TerminationRequest) -> None:
        self.termination = termination
        self.previous_step_time: float | None = None
        """The previous training step's wall time (s, the slowest rank's; identical on every
        rank), settled in this step's first pass; ``None`` before that, in a step without a
        pass, and in the first step of a fit."""
        self._open = False  # a training step started and its first pass has not run yet
        self._start_ns: int | None = None
        self._elapsed_ns = 0  # this rank's last finished step, not yet carried

    def reset(self) -> None:
        """A new fit: no previous step."""
        self.previous_step_time, self._open, self._start_ns, self._elapsed_ns = None, False, None, 0

    def open(self) -> None:
        """A training step starts (its clock too)."""
        self._open = True
        self.previous_step_time = None
        self._start_ns = time.perf_counter_ns()

    def stop(self) -> None:
        """The step's optimizer step ended: its wall time is this rank's ``step_time``."""
        if self._start_ns is not None:
            self._elapsed_ns = time.perf_counter_ns() - self._start_ns
            self._start_ns = None

    def stamp(self, entry: RankInput) -> RankInput:
        """``entry`` with this rank's signal and previous step time (the first pass of a
        training step; other passes: unchanged, zeros)."""
        if not self._open:
            return entry
        return replace(entry, signal=self.termination.received or 0, step_time_ns=self._elapsed_ns)

    def settle(self, table: torch.Tensor) -> None:
        """After the first pass's collective: act on the agreed signal (every rank) and keep the
        slowest rank's previous step time."""
        if not self._open:
            return
        self._open = False
        self._elapsed_ns = 0
        entries = table.tolist()
        slowest = max(entry[_STEP_TIME] for entry in entries)
        self.previous_step_time = slowest / 1e9 if slowest > 0 else None
        self.termination.act(max(entry[_SIGNAL] for entry in entries))

    def finish(self, device: torch.device | str, group: Any) -> float | None:
        """The last step's wall time, the slowest rank's: ONE all-reduce (MAX) over ``group``
        (every rank, at the same point: the end of training); ``None`` when no step ran."""
        value = torch.tensor([self._elapsed_ns], dtype=torch.int64, device=device)
        self._elapsed_ns = 0
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        slowest = int(value.cpu())
        return slowest / 1e9 if slowest > 0 else None


__all__ = [
    "INVALID",
    "NONFINITE",
    "OK",
    "BatchMismatchError",
    "RankInput",
    "StepBoundary",
    "agreed_verdict",
    "check_agreement",
    "check_replica_agreement",
    "gather_inputs",
    "gather_rejections",
    "rejected_ranks",
]
