"""The step's ONE agreement collective: every rank's `[verdict, replica, rows, width,
fingerprint, signal, step_time_ns]` (int64; `replica` = its DP rank), all-gathered into a
`[world, 7]` table from which every rank derives the same decision: the MAX verdict (the
non-finite policy), `BatchMismatchError` on unequal row counts or unequal batches within a model
replica, and the training step's `StepBoundary` (MAX signal and MAX previous step time)."""

# Unequal row counts stall megatron's schedule or the statistics' all-gather; TP peers given
# different data would silently train on a mix. Carrying the SIGTERM flag and the previous step's
# time in the same table gives a training step one world-group collective before its model
# runs, not three.

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
    """One rank's entry of the agreement table (rows/width/fingerprint 0 for a rejected batch;
    signal/step_time_ns 0 outside a training step's first pass)."""

    verdict: int  # OK, NONFINITE or INVALID
    replica: int  # the rank's data-parallel rank (its model replica)
    rows: int = 0  # B
    width: int = 0  # S
    fingerprint: int = 0  # train/validation.py:batch_fingerprint
    signal: int = 0  # a terminating signal this rank received (StepBoundary)
    step_time_ns: int = 0  # this rank's previous training step, ns (StepBoundary)


def gather_inputs(entry: RankInput, device: torch.device | str, group: Any) -> torch.Tensor:
    """The ONE collective: `entry` of every rank of `group` (None: the default group) as a
    `[world, 7]` int64 table on the CPU, in group-rank order."""
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
    """The MAX verdict over the ranks, after `check_agreement` when no rank rejected.

    Raises:
        BatchMismatchError: see `check_agreement`.
    """
    verdict = max(row[_VERDICT] for row in table.tolist())
    if verdict != INVALID:
        check_agreement(table)
    return verdict


def rejected_ranks(table: torch.Tensor) -> list[int]:
    """The group ranks of the gathered `table` that rejected their batch (`INVALID`)."""
    return [r for r, entry in enumerate(table.tolist()) if entry[_VERDICT] == INVALID]


def gather_rejections(error: BaseException | None, group: Any) -> dict[int, str]:
    """`{global rank: "ValueError: <first line>"}` of the ranks of `group` whose `error` is not
    None (collective: every rank calls it)."""
    # called only once the agreement showed that some ranks rejected their batch and others did
    # not: it costs nothing on a good step, nor when every rank raises its own error
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
    """Equal row counts on every rank, and equal width and fingerprint within each replica of
    `table` (`[world, 7]`, from `gather_inputs`).

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
    """The same batch (rows, width, fingerprint) on the ranks of each model replica of `table`
    (`[world, 7]`); `where` heads the message.

    Raises:
        BatchMismatchError: naming the replica's ranks and their rows, widths or fingerprints.
    """
    # the replicas may hold different row counts: a rollout (`rollout/preflight.py`) needs only
    # its TP/PP ranks to run the same generation
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
    """Equal `columns` (index, what) on the ranks of each replica, else `BatchMismatchError`."""
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
    """What a training step agrees on at its start (the SIGTERM flag, the previous step's wall
    time), carried by its first agreement collective; `termination`: the strategy's request."""

    # The strategy calls `open` at every training batch start and `stop` after the optimizer
    # step; the step's first pass `stamp`s its entry and `settle`s the gathered table. Later
    # passes and passes outside training steps (validation) carry zeros and settle nothing.

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
        """`entry` with this rank's signal and previous step time (a training step's first
        pass; other passes: unchanged)."""
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
        """The last step's wall time, the slowest rank's: ONE all-reduce (MAX) over `group`
        (every rank, at the end of training); `None` when no step ran."""
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
