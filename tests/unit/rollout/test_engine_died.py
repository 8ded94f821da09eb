"""How the vLLM source names a dead engine (``EngineDiedError``, issue 37 item 5) and quiets
vLLM's per-refit rotary warning (item 8), without vLLM: real processes and a real torch module.

The engine's processes are stood in for by plain ``multiprocessing``/``subprocess`` children
(what ``VLLMRolloutSource`` watches is only their pids and exit statuses; the real engine is
killed in ``tests/distributed/rollout/test_vllm_engine_failures.py``, vLLM environment)."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_mcore_rl.reliability.processes import is_collective_failure
from lightning_mcore_rl.rollout import (
    EngineDiedError,
    OneRankRolloutSource,
    SamplingConfig,
    VLLMRolloutSource,
)
from lightning_mcore_rl.rollout.vllm_refit import (
    UnloadedBufferFilter,
    derived_only_layers,
    exit_status,
    process_gone,
    quiet_unloaded_buffers,
    zombie_exitcode,
)
from lightning_mcore_rl.testing import run_on_ranks


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _engine_stand_in() -> multiprocessing.Process:
    """A spawned child that sleeps, as vLLM's engine-core process is one (``spawn``)."""
    engine = multiprocessing.get_context("spawn").Process(
        target=time.sleep, args=(600,), name="EngineCore"
    )
    engine.start()
    return engine


def _owner(engine: multiprocessing.Process, worker_pid: int | None) -> VLLMRolloutSource:
    """A generator-side ``VLLMRolloutSource`` without vLLM: only what watches the engine."""
    source = object.__new__(VLLMRolloutSource)
    source.src, source.llm = 0, object()  # is_generator
    source._engines, source._worker_pid = [engine], worker_pid
    return source


def test_engine_died_error_is_no_collective_failure_and_survives_the_broadcast():
    try:
        try:
            raise RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:4242")
        except RuntimeError as closed:
            raise EngineDiedError("the vLLM engine died", pid=42, exitcode=-9) from closed
    except EngineDiedError as died:
        assert is_collective_failure(died.__cause__)  # the closed connection alone would be
        assert not is_collective_failure(died)  # named: never re-raised as CollectiveFailure
        copy = pickle.loads(pickle.dumps(died))  # what the other ranks raise
        assert (type(copy), str(copy), copy.pid, copy.exitcode) == (
            EngineDiedError, "the vLLM engine died", 42, -9,
        )  # fmt: skip


def test_exit_status_in_words():
    assert exit_status(-9) == "exit status -9 (killed by SIGKILL)"
    assert exit_status(1) == "exit status 1"


def test_a_killed_childs_status_is_read_before_it_is_reaped():
    child = _sleeper()
    try:
        assert not process_gone(child.pid) and zombie_exitcode(child.pid) is None
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not process_gone(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_gone(child.pid) and zombie_exitcode(child.pid) == -9  # a zombie
    finally:
        child.kill()
        child.wait()
    assert process_gone(child.pid) and zombie_exitcode(child.pid) is None  # reaped


def test_a_killed_engine_is_named_with_its_pid_and_status_while_a_call_waits_on_it():
    """``_watched``: a call blocked forever on the engine (vLLM's ``generate`` on a SIGKILLed
    engine) ends in ``EngineDiedError`` as soon as the engine process is gone."""
    engine, worker = _engine_stand_in(), _sleeper()
    source = _owner(engine, worker.pid)
    try:
        assert source.engine_failure() is None
        assert source.engine_pids == (engine.pid, worker.pid)
        threading.Timer(0.5, engine.kill).start()
        started = time.monotonic()
        with pytest.raises(EngineDiedError) as raised:
            source._watched(threading.Event().wait, "blocked-on-the-engine")
        assert time.monotonic() - started < 5
        assert str(raised.value).startswith(
            f"VLLMRolloutSource: the vLLM engine of rank 0 died: its engine process "
            f"'EngineCore' (pid {engine.pid}) exited with exit status -9 (killed by SIGKILL). "
        )
        assert "stalled" not in str(raised.value)
        assert (raised.value.pid, raised.value.exitcode) == (engine.pid, -9)
    finally:
        engine.kill()
        worker.kill()
        worker.wait()


def test_a_dead_worker_is_named_and_the_engine_given_time_to_exit():
    """The worker gone first (its own process): named with its status, then the engine process
    once it exits (vLLM shuts it down; here it is killed 0.5 s later, within ``settle_s``)."""
    engine, worker = _engine_stand_in(), _sleeper()
    source = _owner(engine, worker.pid)
    try:
        worker.kill()
        threading.Timer(0.5, engine.kill).start()
        # the owner polls every 0.2 s; a SIGKILL lands after a moment on a loaded machine
        failure, deadline = None, time.monotonic() + 5
        while failure is None and time.monotonic() < deadline:
            failure = source.engine_failure(settle_s=10)
            time.sleep(0.05)
        message = str(failure)
        assert (
            f"died: its worker process (pid {worker.pid}) exited with exit status -9 (killed "
            f"by SIGKILL); its engine process 'EngineCore' (pid {engine.pid}) exited with exit "
            "status -9 (killed by SIGKILL)."
        ) in message
    finally:
        engine.kill()
        worker.wait()


def test_a_call_failing_on_a_live_engine_raises_its_own_error():
    engine = _engine_stand_in()
    try:

        def fails() -> None:
            raise ValueError("a bad request")

        with pytest.raises(ValueError, match="a bad request"):
            _owner(engine, None)._watched(fails, "failing-call")
    finally:
        engine.kill()


class _Rotary(torch.nn.Module):
    """Like vLLM's ``RotaryEmbedding``: a cache computed from the config, no weight."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2), persistent=False)


class _Stats(torch.nn.Module):
    """Persistent buffers only (checkpoint state, like BatchNorm's): stays reported."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(2))


def test_only_the_derived_buffer_layers_failed_load_warning_is_dropped(caplog):
    model = torch.nn.Sequential(_Rotary(), torch.nn.Linear(2, 2), _Stats())
    assert derived_only_layers(model) == frozenset({"_Rotary"})
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = quiet_unloaded_buffers(model)
    try:
        assert quiet_unloaded_buffers(model) is quiet  # installed once
        with caplog.at_level(logging.WARNING, logger=logger.name):
            for layer in ("_Rotary", "Linear", "_Stats"):
                logger.warning("%s: Failed to load weights", layer)  # vLLM's exact call
            logger.warning("%s: something else", "_Rotary")
        assert [r.getMessage() for r in caplog.records] == [
            "Linear: Failed to load weights",
            "_Stats: Failed to load weights",
            "_Rotary: something else",
        ]
    finally:
        logger.removeFilter(quiet)
    assert isinstance(quiet, UnloadedBufferFilter)


class _DyingSource(OneRankRolloutSource):
    """A one-rank source whose generator's draw finds its engine dead (stands in for
    ``VLLMRolloutSource._draw`` on a killed engine)."""

    def __init__(self) -> None:
        self.group, self.src = dist.group.WORLD, 0

    @property
    def is_generator(self) -> bool:
        return dist.get_rank() == 0

    def _draw(self, tokens: Any, logprobs: Any, lengths: Any, sampling: Any) -> None:
        raise EngineDiedError("the vLLM engine of rank 0 died: pid 4242", pid=4242, exitcode=-9)


def _sample_with_a_dead_engine(rank: int, background: bool) -> tuple[str, str, int | None]:
    source = _DyingSource()
    prompts, sampling = torch.ones(2, 3, dtype=torch.long), SamplingConfig(max_new_tokens=2)
    try:
        if background:
            source.submit(prompts, sampling).result()
        else:
            source.generate(prompts, sampling)
    except Exception as error:
        return type(error).__name__, str(error), getattr(error, "pid", None)
    return "", "", None


@pytest.mark.parametrize("background", [False, True])
def test_a_draw_that_finds_the_engine_dead_raises_that_error_on_every_rank(background):
    """Not wrapped in "could not sample" RuntimeError: the same ``EngineDiedError``, its pid
    kept, on the generator and on the rank it broadcasts to."""
    results = run_on_ranks(_sample_with_a_dead_engine, 2, background, emulate_cuda=False)
    expected = ("EngineDiedError", "the vLLM engine of rank 0 died: pid 4242", 4242)
    assert results == [expected, expected]
