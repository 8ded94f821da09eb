"""Run a function on N local gloo ranks and collect each rank's result."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# ranks fork from a forkserver that has already imported torch and megatron-core: a multi-rank test
# pays the import once per session instead of once per rank per test (BENCHMARKS.md); a forkserver,
# not plain fork from pytest, keeps the children safe from thread pools the parent may have started
_PRELOAD = ["lightning_mcore_rl.testing._preload"]
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # port 0: the OS picks a free one, on which the ranks then rendezvous
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    sys_path: list[str],
    payload: bytes,
    emulate_cuda: bool,
    timeout: float,
    conn: Any,
) -> None:
    """Entry point of one spawned rank: set up env + gloo, run `fn`, report, tear down."""
    import torch
    import torch.distributed as dist

    # the parent's sys.path: `fn` may live in a test module only pytest's paths reach
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    # one intra-op thread per rank: the N ranks share the machine's cores
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            # a hung collective fails within the run's timeout, not gloo's default
            timeout=datetime.timedelta(seconds=timeout),
        )
        from lightning_mcore_rl.cpu.emulation import cpu_emulation
        from lightning_mcore_rl.testing.megatron_state import destroy_megatron_state

        scope = cpu_emulation() if emulate_cuda else contextlib.nullcontext()
        message: tuple[str, float, bytes | str]  # ("ok", t, pickled result) / ("error", t, tb)
        try:
            with scope:
                result = fn(rank, *args)
            message = ("ok", time.time(), pickle.dumps(result))
        except BaseException:
            message = ("error", time.time(), traceback.format_exc())
        # Report before teardown closes this rank's sockets (peers then fail too, but later).
        conn.send(message)
        destroy_megatron_state()
        dist.destroy_process_group()
    except BaseException:  # set-up or teardown failed: still report, with the traceback
        conn.send(("error", time.time(), traceback.format_exc()))
    finally:
        conn.close()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    emulate_cuda: bool = True,
) -> list[Any]:
    """Run `fn(rank, *args)` (module-level, picklable) on `world_size` gloo ranks, by default inside
    `cpu_emulation()`, and return the results in rank order; megatron's state and the process group
    are destroyed when `fn` returns.

    Raises:
        RuntimeError: a rank raised (the first to fail, with its traceback; the others are killed).
        TimeoutError: not every rank finished within `timeout` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"`timeout` must be positive, got {timeout!r}")
    try:
        payload = pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(
            f"run_on_ranks needs a module-level function and picklable args; pickling {fn!r} "
            f"failed: {err}"
        ) from err

    ctx = _context()
    port = _free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                list(sys.path),
                payload,
                emulate_cuda,
                timeout,
                child_conn,
            ),
            name=f"rank{rank}",
            # not daemonic: megatron's checkpoint writer forks worker processes from the rank.
            # Ranks are killed in the `finally` below whatever happens.
            daemon=False,
        )
        proc.start()
        child_conn.close()
        procs.append(proc)
        conns.append(parent_conn)

    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            _collect(conns, procs, results, errors)
            if errors:
                _raise_first_error(conns, procs, results, errors)
            # the deadline covers the whole run; every rank is killed on expiry
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(
                    f"run_on_ranks: ranks {missing} of {world_size} did not finish within "
                    f"{timeout:.0f} s (finished: {sorted(results)}); all ranks were killed."
                )
            time.sleep(0.01)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in conns:
            conn.close()
    return [results[r] for r in range(world_size)]


def _collect(
    conns: list[Any],
    procs: list[Any],
    results: dict[int, Any],
    errors: dict[int, tuple[float, str]],
) -> None:
    """Move every rank's pending message into `results` or `errors`."""
    for rank, (conn, proc) in enumerate(zip(conns, procs, strict=True)):
        if rank in results or rank in errors:
            continue
        if conn.poll():
            try:
                status, when, body = conn.recv()
            except EOFError:
                status, when, body = (
                    "error",
                    time.time(),
                    "the rank closed its pipe without a result",
                )
            if status == "error":
                errors[rank] = (when, body)
            else:
                results[rank] = pickle.loads(body)
        elif not proc.is_alive() and not conn.poll():
            errors[rank] = (
                time.time(),
                f"exited with code {proc.exitcode} without a result (killed by a signal or "
                "crashed in native code)",
            )


def _raise_first_error(
    conns: list[Any],
    procs: list[Any],
    results: dict[int, Any],
    errors: dict[int, tuple[float, str]],
) -> None:
    """Raise the error of the rank that failed FIRST."""
    # a rank's failure makes its peers fail moments later in collectives: wait briefly for every
    # report and blame the earliest
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace and len(results) + len(errors) < len(procs):
        _collect(conns, procs, results, errors)
        time.sleep(0.01)
    rank = min(errors, key=lambda r: errors[r][0])
    others = sorted(set(errors) - {rank})
    also = f" (ranks {others} failed after it)" if others else ""
    raise RuntimeError(f"run_on_ranks: rank {rank} failed{also}:\n{errors[rank][1]}")
