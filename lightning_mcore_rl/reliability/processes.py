"""No process outlives a failed run: the world rendezvous with its own timeout (`connect_world`),
forked children that die with their rank (`die_with_parent`), and a failed collective re-raised
as `CollectiveFailure` naming every peer's state (`RankTable`, `collective_failure`)."""

# `init_process_group(timeout=...)` alone bounds the rendezvous too, so a short collective
# timeout failed start-up on a loaded machine. A forked child (megatron's checkpoint shard
# writers, DataLoader workers) inherits the rank's sockets: alive, it kept them open (its peers
# then waited for the whole timeout) or lived on as an orphan. A peer is named stalled only if
# still alive after a short re-check: a dying peer closes its sockets before it shows as exited.
# At exit the peers left on this host are killed after a grace period: a stalled rank never
# returns from its collective by itself.

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

_PR_SET_PDEATHSIG = 1
_FAILURE_TEXT = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")
_RECHECK_GRACE_S = 1.0
"""How long :func:`collective_failure` re-reads peers that all look alive before naming them
stalled (a SIGKILLed peer is a zombie within milliseconds; a stalled one costs this much)."""


def connect_world(
    main_address: str,
    main_port: int,
    backend: str,
    rank: int,
    world_size: int,
    *,
    timeout: timedelta | None,
    rendezvous_timeout: timedelta,
) -> None:
    """Initialise the default process group (no-op when it exists): the `env://` rendezvous and
    the store's later key waits (group creation) wait up to `rendezvous_timeout`, the
    collectives `timeout`."""
    # the rendezvous is torch's own `env://` handler: a TCP store on main_address:main_port, or
    # torchrun's agent store
    if dist.is_initialized():
        return
    from torch.distributed.rendezvous import rendezvous

    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    store, rank, world_size = next(
        rendezvous("env://", rank, world_size, timeout=rendezvous_timeout)
    )
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)


_fork_state = {"registered": False, "from_main": False, "parent": 0}


def _before_fork() -> None:
    _fork_state["from_main"] = threading.current_thread() is threading.main_thread()
    _fork_state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    if not _fork_state["from_main"]:  # the death signal follows the forking THREAD's exit
        return
    libc = ctypes.CDLL(None, use_errno=True)
    armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if armed and os.getppid() != _fork_state["parent"]:  # the parent died before prctl
        os._exit(1)


def die_with_parent() -> bool:
    """From now on, a process forked from this process's main thread is SIGKILLed when this
    process dies (`PR_SET_PDEATHSIG` via `os.register_at_fork`; idempotent); returns whether
    it is in place (Linux only)."""
    if not Path("/proc/self").is_dir():
        return False
    if not _fork_state["registered"]:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_state["registered"] = True
    return True


@dataclass(frozen=True)
class RankProcess:
    """Where one rank runs: its host name and process id."""

    host: str
    pid: int


def process_state(pid: int) -> str:
    """`"exited"`, `"stopped"` or `"alive"`, from `/proc/<pid>/stat` (a zombie has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exited"
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(state, "alive")


def exit_detail(pid: int) -> str:
    """How an exited (not yet reaped) process ended: `"killed by SIGKILL"`, `"exit status 1"`;
    `""` when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    # Field 52 of proc(5) (index 49 after the command name): the waitpid(2) status, Linux >= 3.5;
    # meaningful for a zombie only (a running process holds 0 there).
    if fields[0] not in ("Z", "X") or len(fields) < 50:
        return ""
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else ""


def _state_text(pid: int) -> str:
    """:func:`process_state` with :func:`exit_detail`: ``"exited (killed by SIGKILL)"``."""
    state, detail = process_state(pid), exit_detail(pid)
    return f"{state} ({detail})" if detail else state


class CollectiveFailure(RuntimeError):
    """A collective failed because a peer exited, stopped or did not answer within the timeout
    (`rank_local`: each rank prints its own traceback, `rank_errors.RankExceptHook`)."""

    rank_local = True


@dataclass(frozen=True)
class RankTable:
    """Every rank's :class:`RankProcess` (index = global rank) and this process's rank."""

    processes: tuple[RankProcess, ...]
    rank: int

    @classmethod
    def gather(cls, group: Any) -> RankTable:
        """Collective over ``group`` (all ranks): every rank's host and pid."""
        me = RankProcess(socket.gethostname(), os.getpid())
        table: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(table, me, group=group)
        return cls(tuple(table), dist.get_rank())

    def local_peers(self) -> dict[int, int]:
        """``{rank: pid}`` of the other ranks on this host."""
        me = self.processes[self.rank]
        return {
            r: p.pid for r, p in enumerate(self.processes) if r != self.rank and p.host == me.host
        }

    def describe(self) -> str:
        """Each peer's state: ``rank 1 (pid 42): stopped; rank 2 (host b): on another host``."""
        local = self.local_peers()
        parts = []
        for r, p in enumerate(self.processes):
            if r == self.rank:
                continue
            state = _state_text(local[r]) if r in local else f"on host {p.host}, not checked"
            parts.append(f"rank {r} (pid {p.pid}): {state}")
        return "; ".join(parts)

    def end_local_peers_at_exit(self, grace_s: float) -> None:
        """When this process exits, `end_local_peers` with what is left of `grace_s` from now."""
        # `atexit`: after the traceback is printed, so the error is not delayed
        deadline = time.monotonic() + grace_s
        atexit.register(lambda: self.end_local_peers(deadline - time.monotonic()))

    def end_local_peers(self, grace_s: float) -> list[int]:
        """Give the peers on this host `grace_s` seconds to exit by themselves, then SIGKILL those
        still there (a stopped or stalled rank); returns the ranks killed."""
        # by themselves: another rank that saw the failure prints its own message first
        pending = self.local_peers()
        deadline = time.monotonic() + max(grace_s, 0.0)
        while pending and time.monotonic() < deadline:
            pending = {r: pid for r, pid in pending.items() if process_state(pid) != "exited"}
            time.sleep(0.1)
        killed = []
        for r, pid in pending.items():
            if process_state(pid) != "exited":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(r)
        return killed


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` (or its cause/context chain, or the failures of torch's
    `CheckpointException`) is a failed collective: `torch.distributed.DistError` or a
    `RuntimeError` whose text says the connection closed/reset or the operation timed out."""
    # An error that already names the failed process (`names_failed_process = True` on its
    # class, e.g. `rollout.EngineDiedError`: the vLLM engine died, its refit connection closed)
    # is not one, whatever it chains: every rank raises it as it is, no peer blamed or killed.
    pending: list[Any] = [error]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        # Already named: re-raising it as a CollectiveFailure would blame a healthy rank.
        if isinstance(item, CollectiveFailure) or getattr(item, "names_failed_process", False):
            return False
        if isinstance(item, dist.DistError):
            return True
        if isinstance(item, RuntimeError) and any(t in str(item).lower() for t in _FAILURE_TEXT):
            return True
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            pending.extend(v[0] if isinstance(v, tuple) and v else v for v in failures.values())
        pending.extend((item.__cause__, item.__context__))
    return False


def settled_states(peers: dict[int, int], grace_s: float = _RECHECK_GRACE_S) -> dict[int, str]:
    """`{rank: process_state}` of `peers` (`{rank: pid}`); when every peer reads `"alive"`,
    re-read them for up to `grace_s` seconds until one is not."""
    states = {r: process_state(pid) for r, pid in peers.items()}
    deadline = time.monotonic() + max(grace_s, 0.0)
    # A SIGKILLed peer's sockets close while the kernel tears it down, BEFORE /proc shows it as
    # a zombie: read at once, a dying peer looks alive and would be blamed as "stalled".
    while states and all(s == "alive" for s in states.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        states = {r: process_state(pid) for r, pid in peers.items()}
    return states


def collective_failure(
    error: BaseException, table: RankTable, step: int, *, grace_s: float = _RECHECK_GRACE_S
) -> CollectiveFailure:
    """The `CollectiveFailure` for `error` seen by `table.rank` at global `step`: the peers that
    exited or stopped first (the likely cause), then every peer's state."""
    # stalled only if still alive `grace_s` seconds later (`settled_states`): a peer dying when
    # the collective failed has exited by then
    local = table.local_peers()
    states = settled_states(local, grace_s)
    culprits = [
        f"rank {r} {_state_text(local[r]) if s == 'exited' else s}"
        for r, s in sorted(states.items())
        if s != "alive"
    ]
    silent = [f"rank {r}" for r, s in sorted(states.items()) if s == "alive"]
    if culprits:
        cause = ", ".join(culprits)
    elif silent:
        cause = f"{', '.join(silent)} alive but not answering (stalled)"
    else:
        cause = "a rank on another host"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CollectiveFailure(
        f"Rank {table.rank} at global step {step}: a collective failed because of {cause} "
        f"({table.describe()}). The peers still on this host are killed at exit; resume with "
        f'`fit(ckpt_path="last")`. The error: {type(error).__name__}: {first}'
    )


__all__ = [
    "CollectiveFailure",
    "RankProcess",
    "RankTable",
    "collective_failure",
    "connect_world",
    "die_with_parent",
    "exit_detail",
    "is_collective_failure",
    "process_state",
    "settled_states",
]
