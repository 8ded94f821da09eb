"""Run real processes for the launch tests and wait on their progress, not on a wall clock.

Each process's stdout and stderr are copied to files in a folder; a run is waited on while
anything in that folder changes, so a loaded machine only makes a test slower, and a hang (no
output, no new file for ``STALL_S`` seconds) fails it with the processes' output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

STALL_S = 120
"""A run fails after this long without progress. The longest silent phase is a process's imports
(torch, Lightning, megatron-core): measured up to ~40 s at load average 20 on 2 cores."""


@dataclass(frozen=True)
class Finished:
    """What the processes left: their exit codes, stdouts and stderrs, in start order."""

    returncodes: list[int]
    stdouts: list[str]
    stderrs: list[str]


def run_processes(
    folder: Path, commands: list[tuple[list[str], dict[str, str]]], cwd: Path | None = None
) -> Finished:
    """Start every ``(command, env)`` at once, each in its own session, its stdout and stderr
    copied line by line to ``folder/process{i}.out|.err``. Return when every output stream is
    closed (the process and the children it started are done); when one process exits with a
    non-zero code, kill the others' process groups (they would wait for it). Fail on ``STALL_S``
    seconds without progress in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [(folder / f"process{i}.out", folder / f"process{i}.err") for i in range(len(commands))]
    procs: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    try:
        for (cmd, env), files in zip(commands, paths, strict=True):
            proc = subprocess.Popen(
                cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            procs.append(proc)
            for pipe, path in zip((proc.stdout, proc.stderr), files, strict=True):
                pumps.append(threading.Thread(target=_copy, args=(pipe, path), daemon=True))
                pumps[-1].start()
        _wait_while_progressing(folder, procs, pumps, paths)
    finally:
        for proc in procs:
            kill_group(proc)
    for pump in pumps:
        pump.join()
    return Finished(
        returncodes=[proc.returncode for proc in procs],
        stdouts=[out.read_text() for out, _ in paths],
        stderrs=[err.read_text() for _, err in paths],
    )


def _copy(pipe: IO[str], path: Path) -> None:
    """Copy ``pipe`` to ``path`` line by line until every writer has closed it."""
    with path.open("w") as sink:
        for line in iter(pipe.readline, ""):
            sink.write(line)
            sink.flush()
    pipe.close()


def _wait_while_progressing(
    folder: Path,
    procs: list[subprocess.Popen[str]],
    pumps: list[threading.Thread],
    paths: list[tuple[Path, Path]],
) -> None:
    last, last_change = _progress(folder), time.monotonic()
    while any(pump.is_alive() for pump in pumps) or any(p.poll() is None for p in procs):
        failed = [i for i, proc in enumerate(procs) if proc.poll() not in (None, 0)]
        if failed:
            for i, proc in enumerate(procs):
                if i not in failed:
                    kill_group(proc)
        now = _progress(folder)
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            tails = "\n".join(path.read_text()[-3000:] for pair in paths for path in pair)
            pytest.fail(f"no progress for {STALL_S} s (a hang); the processes' output:\n{tails}")
        time.sleep(0.5)


def _progress(folder: Path) -> tuple[int, ...]:
    """What changes while processes work: the size of every entry under ``folder`` (their
    output, results, checkpoint shards)."""
    sizes = []
    for path in sorted(folder.rglob("*")):
        with contextlib.suppress(FileNotFoundError):  # a checkpoint's temporary file renamed
            sizes.append(path.stat().st_size)
    return tuple(sizes)


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill what is left of the process group started for ``proc`` (its children included, e.g.
    torchrun's workers or the rank Lightning's launcher started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
