"""The pieces behind "no process outlives a failed run", in one process with real signals and
real child processes (the launches themselves: ``tests/distributed/launch/
test_launch_failures.py``): the SIGTERM request, process states, the failure message, killing
the peers left, children dying with their parent, the rendezvous timeout's validation, and the
traceback of a rank-local error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_mcore_rl.rank_errors import RankExceptHook
from lightning_mcore_rl.reliability import processes
from lightning_mcore_rl.reliability.agreement import OK, RankInput, StepBoundary, gather_inputs
from lightning_mcore_rl.reliability.processes import (
    CollectiveFailure,
    RankProcess,
    RankTable,
    collective_failure,
    die_with_parent,
    is_collective_failure,
    process_state,
)
from lightning_mcore_rl.reliability.signals import TerminationRequest
from lightning_mcore_rl.strategy.config import ReliabilityConfig


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_sigterm_is_recorded_and_acted_on_only_once_agreed():
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        request = TerminationRequest()
        request.install()
        assert request.act(0) is None and calls == []  # nothing agreed
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, the process lives on
        assert request.received == signal.SIGTERM and calls == []
        assert request.act(signal.SIGTERM) == signal.SIGTERM  # the agreed MAX over the ranks
        assert calls == [signal.SIGTERM]  # the previous handler, called once agreed
        assert request.act(signal.SIGTERM) == signal.SIGTERM and len(calls) == 1
        assert request.act(0) == signal.SIGTERM and len(calls) == 1  # agreed stays agreed
        request.restore()
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM] * 2  # the previous handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_step_boundary_rides_on_the_first_agreement_of_a_training_step():
    """One gloo-free process: the boundary stamps a training step's first pass with this rank's
    signal and previous step time, settles on the gathered table (MAX over the ranks: a
    two-rank table made by hand), and leaves later passes and non-training passes alone."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        request = TerminationRequest()
        request.install()
        boundary = StepBoundary(request)
        entry = RankInput(OK, replica=0, rows=4, width=8, fingerprint=7)
        assert boundary.stamp(entry) == entry  # outside a training step: nothing rides along
        boundary.open()  # step 0: no previous step
        first = boundary.stamp(entry)
        assert (first.signal, first.step_time_ns) == (0, 0)
        boundary.settle(gather_inputs(first, "cpu", None))
        assert boundary.previous_step_time is None and calls == []
        boundary.stop()
        boundary.open()  # step 1: carries step 0's time
        stamped = boundary.stamp(entry)
        assert stamped.step_time_ns > 0 and stamped.signal == 0
        assert stamped.rows == 4 and stamped.fingerprint == 7  # the batch summary unchanged
        os.kill(os.getpid(), signal.SIGTERM)  # another rank's signal arrives in the table
        peer = RankInput(OK, replica=0, rows=4, width=8, fingerprint=7, signal=signal.SIGTERM,
                         step_time_ns=stamped.step_time_ns + 5_000_000)  # fmt: skip
        table = torch.cat([gather_inputs(stamped, "cpu", None), gather_inputs(peer, "cpu", None)])
        boundary.settle(table)
        assert boundary.previous_step_time == pytest.approx(stamped.step_time_ns / 1e9 + 5e-3)
        assert calls == [signal.SIGTERM] and request.agreed == signal.SIGTERM  # acted on once
        assert boundary.stamp(entry) == entry  # a later pass of the same step: nothing
        boundary.stop()
        assert boundary.finish("cpu", None) > 0  # the last step's time (no group: this rank)
        assert boundary.finish("cpu", None) is None  # carried once
        request.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_process_states_of_real_children():
    assert process_state(os.getpid()) == "alive"
    child = sleeper()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "stopped"
        child.kill()
        while process_state(child.pid) != "exited" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "exited"  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "exited"


def test_a_failed_collective_names_the_rank_the_step_and_the_peers_then_kills_them():
    stopped, alive = sleeper(), sleeper()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        me = RankProcess("here", os.getpid())
        table = RankTable(
            (me, RankProcess("here", stopped.pid), RankProcess("here", alive.pid),
             RankProcess("there", 1)),
            rank=0,
        )  # fmt: skip
        error = collective_failure(RuntimeError("Timed out waiting 5000ms\nmore"), table, step=7)
        assert isinstance(error, CollectiveFailure) and error.rank_local
        assert str(error).startswith(
            "Rank 0 at global step 7: a collective failed because of rank 1 stopped "
            f"(rank 1 (pid {stopped.pid}): stopped; rank 2 (pid {alive.pid}): alive; "
            "rank 3 (pid 1): on host there, not checked)."
        )
        assert str(error).endswith("The error: RuntimeError: Timed out waiting 5000ms")
        started = time.monotonic()
        assert table.end_local_peers(grace_s=0.5) == [1, 2]
        assert time.monotonic() - started >= 0.5  # they had the grace to exit by themselves
        for child in (stopped, alive):
            assert child.wait(timeout=10) == -signal.SIGKILL
        silent = RankTable((me, RankProcess("here", sleeper().pid)), rank=0)
        message = str(collective_failure(RuntimeError("Timed out"), silent, step=3))
        assert "because of rank 1 alive but not answering (stalled)" in message
        silent.end_local_peers(grace_s=0)
    finally:
        for child in (stopped, alive):
            child.kill()
            child.wait()


def test_a_peer_dying_as_the_collective_fails_is_named_exited_not_stalled():
    """A SIGKILLed peer's sockets close before /proc shows it as a zombie: a peer read "alive"
    at first is re-read for the grace before it is called stalled (issue 37 item 7)."""
    me = RankProcess("here", os.getpid())
    dying = sleeper()
    try:
        killer = threading.Timer(0.3, dying.kill)  # dies after the first read, within the grace
        table = RankTable((me, RankProcess("here", dying.pid)), rank=0)
        assert process_state(dying.pid) == "alive"
        killer.start()
        message = str(collective_failure(RuntimeError("Connection closed by peer"), table, 4))
        killer.join()
        assert "because of rank 1 exited (killed by SIGKILL) (" in message, message
        assert f"rank 1 (pid {dying.pid}): exited (killed by SIGKILL)" in message
        assert "stalled" not in message
    finally:
        dying.kill()
        dying.wait()
    stalled = sleeper()
    try:
        table = RankTable((me, RankProcess("here", stalled.pid)), rank=0)
        started = time.monotonic()
        message = str(collective_failure(RuntimeError("Timed out"), table, 4, grace_s=0.4))
        assert time.monotonic() - started >= 0.4  # re-checked for the whole grace
        assert "because of rank 1 alive but not answering (stalled)" in message
    finally:
        stalled.kill()
        stalled.wait()


_EXIT_SCRIPT = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("processes", sys.argv[2])  # not the package: fast
processes = sys.modules["processes"] = importlib.util.module_from_spec(spec)  # dataclasses
spec.loader.exec_module(processes)
RankProcess, RankTable = processes.RankProcess, processes.RankTable
peer = int(sys.argv[1])
table = RankTable((RankProcess("here", os.getpid()), RankProcess("here", peer)), rank=0)
table.end_local_peers_at_exit(grace_s=0.5)
raise RuntimeError("the failure")  # the traceback first, then the peer is killed at exit
"""


def test_the_peers_are_killed_when_the_failing_process_exits():
    peer = sleeper()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_SCRIPT, str(peer.pid), processes.__file__],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1 and "RuntimeError: the failure" in done.stderr
        assert peer.wait(timeout=10) == -signal.SIGKILL
    finally:
        peer.kill()
        peer.wait()


class _CheckpointFailure(BaseException):  # torch's CheckpointException: failures per rank
    def __init__(self, failures: dict) -> None:
        super().__init__("CheckpointException")
        self.failures = failures


@pytest.mark.parametrize(
    "error,expected",
    [
        (dist.DistBackendError("anything"), True),
        (RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), True),
        (_CheckpointFailure({1: (RuntimeError("Timed out waiting 5000ms"), "tb")}), True),
        (ValueError("`prompts_per_step` (5) must be divisible"), False),
        (RuntimeError("shape mismatch"), False),
        (CollectiveFailure("Rank 0 at global step 1: ... Timed out"), False),  # wrapped once
    ],
)
def test_which_errors_are_failed_collectives(error, expected):
    assert is_collective_failure(error) is expected


def test_a_cause_chain_is_searched():
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as inner:
            raise KeyError("while saving") from inner
    except KeyError as outer:
        assert is_collective_failure(outer)


def _fork_grandchild(queue: multiprocessing.Queue) -> None:
    die_with_parent()
    grandchild = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    grandchild.start()
    queue.put(grandchild.pid)
    time.sleep(600)


def test_a_forked_child_dies_with_its_parent():
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue = context.Queue()
    parent = context.Process(target=_fork_grandchild, args=(queue,))
    parent.start()
    grandchild = queue.get(timeout=60)
    assert process_state(grandchild) == "alive"
    os.kill(parent.pid, signal.SIGKILL)  # no handler runs: only the kernel's death signal
    parent.join()
    deadline = time.monotonic() + 10
    while process_state(grandchild) != "exited" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(grandchild) == "exited"


def test_the_rendezvous_timeout_is_typed_at_least_the_timeout_and_defaults_longer():
    assert ReliabilityConfig(timeout=timedelta(seconds=5)).rendezvous_limit == timedelta(minutes=30)
    assert ReliabilityConfig(timeout=timedelta(hours=2)).rendezvous_limit == timedelta(hours=2)
    assert ReliabilityConfig(timeout=None).rendezvous_limit == timedelta(minutes=30)
    given = ReliabilityConfig(timeout=timedelta(seconds=5), rendezvous_timeout=timedelta(seconds=9))
    assert given.rendezvous_limit == timedelta(seconds=9)
    with pytest.raises(TypeError, match=r"`ReliabilityConfig.rendezvous_timeout` must be a "
                       r"datetime.timedelta or None, got int"):  # fmt: skip
        ReliabilityConfig(rendezvous_timeout=60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`ReliabilityConfig.rendezvous_timeout` must be "
                       r"positive, got -1 day"):  # fmt: skip
        ReliabilityConfig(timeout=None, rendezvous_timeout=timedelta(seconds=-1))
    with pytest.raises(ValueError, match=r"`ReliabilityConfig.rendezvous_timeout` \(0:00:05\) "
                       r"must be at least `timeout` \(0:00:10\)"):  # fmt: skip
        ReliabilityConfig(timeout=timedelta(seconds=10), rendezvous_timeout=timedelta(seconds=5))


def test_a_rank_local_error_prints_its_traceback_on_every_rank(monkeypatch):
    seen: list[BaseException] = []
    hook = RankExceptHook(lambda kind, error, traceback: seen.append(error))
    monkeypatch.setattr("lightning_mcore_rl.rank_errors.current_rank", lambda: 1)
    error = CollectiveFailure("Rank 1 at global step 2: ...")
    hook(CollectiveFailure, error, None)
    assert seen == [error]
