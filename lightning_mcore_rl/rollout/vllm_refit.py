"""In-place weight refit of a vLLM engine over a private two-rank process group (rank 0: the
trainer's generating rank, rank 1: vLLM's worker), and the engine's death detection."""

# This module imports no vLLM: vLLM imports `RefitWorkerExtension` by its qualified name in the
# engine's process (LLM(worker_extension_cls=...)).

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

HEADER_LEN = 12
"""``int64`` entries of a tensor's header: name length, dtype code, ndim, up to 9 dims."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
"""The dtypes a refit carries, by code (a header's second entry)."""

TRAINER, WORKER = 0, 1
"""Ranks in the private refit group."""


class EngineDiedError(RuntimeError):
    """The vLLM engine's process or its worker is gone (killed, crashed): raised on every rank
    of the source's group, naming the process, its pid and its exit status."""

    # The strategy raises an error with this flag as it is, not as a CollectiveFailure: the refit
    # connection it closed is no stalled training rank, and no rank is killed for it.
    names_failed_process = True

    def __init__(self, message: str, pid: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[Any, ...]:
        # broadcast to the other ranks of the group (pickled): keep pid and exit status
        return (type(self), (str(self), self.pid, self.exitcode))


def exit_status(exitcode: int) -> str:
    """``exitcode`` in words: ``-9`` is ``"exit status -9 (killed by SIGKILL)"``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit status {exitcode} (killed by {name})"
    return f"exit status {exitcode}"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no ``/proc`` entry, or a zombie not yet reaped)."""
    state = _process_state(Path(f"/proc/{pid}/stat"))
    return state is None or state[0] in ("Z", "X")


def zombie_exitcode(pid: int) -> int | None:
    """The exit status of the exited, unreaped process ``pid`` as ``multiprocessing`` writes one
    (``-9``: SIGKILL); ``None`` when it runs, is reaped, or ``/proc`` does not say."""
    # another process's child: no waitpid here, /proc has its status
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] not in ("Z", "X") or len(fields) < 50:
        return None
    status = int(fields[49])  # field 52 of proc(5): the waitpid(2) status (Linux >= 3.5)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None


def _process_state(stat: Path) -> tuple[str, int] | None:
    """``(state, start time)`` from ``/proc/<pid>/stat``; ``None`` once the process is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def watch_owner(owner_pid: int, interval_s: float = 1.0) -> bool:
    """In vLLM's worker: SIGKILL the engine process and this one once the owner, the trainer rank
    ``owner_pid``, is gone (checked every ``interval_s``). Linux only; whether the watch runs."""
    # Otherwise the engine, holding the rank's stdout and its memory, outlives the run: an owner
    # killed, crashed or exited without shutting it down (a multiprocessing child runs no atexit),
    # and vLLM spawns the engine, so no at-fork hook of the rank binds it.
    stat = Path(f"/proc/{owner_pid}/stat")
    first = _process_state(stat)
    if first is None:
        return False
    # depending on vLLM's executor the worker runs inside the engine process (its parent is the
    # owner) or in a process of its own under it (its parent is the engine)
    engine = os.getpid() if os.getppid() == owner_pid else os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            now = _process_state(stat)
            # a zombie counts as gone; the start time guards against a reused pid
            if now is None or now[0] == "Z" or now[1] != first[1]:
                if engine != os.getpid():
                    # the engine may be gone already (killed with its owner): nothing to end
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(engine, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lmrl-vllm-owner-watch", daemon=True).start()
    return True


def refit_group(store: Any, rank: int, timeout: timedelta, device: torch.device) -> Any:
    """The private two-rank group on ``store``: gloo for CPU tensors, NCCL for CUDA ones.
    Blocks until both ranks have joined."""
    # Bare process groups: vLLM's engine has a torch.distributed world of its own, and neither
    # side's default group may take part. The same send/recv calls serve both backends.
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


# The wire format, one tensor in flight: an int64 header (name length, dtype code, ndim, shape),
# the name's UTF-8 bytes, the tensor; a name length of -1 ends the stream.
def _header(name_len: int, tensor: Tensor | None = None) -> Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = name_len
    if tensor is not None:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"refit: {tensor.dtype} is not one of the dtypes a refit carries.")
        if tensor.dim() > HEADER_LEN - 3:
            raise ValueError(f"refit: a {tensor.dim()}-d tensor has too many dims to send.")
        header[1] = DTYPES.index(tensor.dtype)
        header[2] = tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def send_weights(
    group: Any, weights: Iterable[tuple[str, Tensor]], device: torch.device
) -> tuple[int, int]:
    """Trainer side: send every ``(name, tensor)`` to the worker, then the end; the counts
    ``(tensors, bytes)``."""
    count, size = 0, 0
    for name, tensor in weights:
        raw = torch.tensor(list(name.encode()), dtype=torch.uint8)
        data = tensor.detach().to(device).contiguous()
        for part in (_header(raw.numel(), data).to(device), raw.to(device), data):
            group.send([part], WORKER, 0).wait()
        count, size = count + 1, size + data.numel() * data.element_size()
    group.send([_header(-1).to(device)], WORKER, 0).wait()
    return count, size


def receive_weights(group: Any, device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """Worker side: the ``(name, tensor)`` pairs the trainer sends, as they arrive, to the end."""

    def recv(tensor: Tensor) -> Tensor:
        group.recv([tensor], TRAINER, 0).wait()
        return tensor

    while True:
        # received on the group's device (CUDA under NCCL), parsed on the host
        header = recv(torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)).cpu()
        name_len = int(header[0])
        if name_len < 0:
            return
        name = bytes(recv(torch.zeros(name_len, dtype=torch.uint8, device=device)).tolist())
        ndim = int(header[2])
        shape = [int(s) for s in header[3 : 3 + ndim]]
        yield name.decode(), recv(torch.empty(shape, dtype=DTYPES[int(header[1])], device=device))


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_UNLOADED = "%s: Failed to load weights"
"""vLLM's layerwise reload logs this (its logger, its format) for every layer none of whose
tensors a reload filled, buffers included, once per refit."""


def derived_only_layers(model: torch.nn.Module) -> frozenset[str]:
    """Class names of ``model``'s layers that hold no parameter and only non-persistent buffers
    (``RotaryEmbedding``'s ``cos_sin_cache``), which no refit stream carries."""
    derived, weighted = set(), set()
    for layer in model.modules():
        name = type(layer).__name__
        if any(p is not None for p in layer._parameters.values()):
            weighted.add(name)
        elif layer._buffers and set(layer._buffers) <= layer._non_persistent_buffers_set:
            derived.add(name)
    return frozenset(derived - weighted)  # a name that holds a weight anywhere stays reported


class UnloadedBufferFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for ``layers`` (`derived_only_layers`)."""

    def __init__(self, layers: frozenset[str]) -> None:
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is logged."""
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == _UNLOADED and len(args) == 1 and args[0] in self.layers)


def quiet_unloaded_buffers(model: torch.nn.Module) -> UnloadedBufferFilter:
    """Install (once) the `UnloadedBufferFilter` of ``model`` on vLLM's reload logger."""
    logger = logging.getLogger(_RELOAD_LOGGER)
    for installed in logger.filters:
        if isinstance(installed, UnloadedBufferFilter):
            return installed
    # Why a filter: vLLM's layerwise reload counts a layer's buffers as tensors to load, so a
    # layer of non-persistent buffers alone (RotaryEmbedding's cos_sin_cache) is "not loaded" at
    # every refit, logged as a warning, then put back unchanged
    # (vLLM's fallback, `_place_kernel_tensors`): nothing is missing, no weight to send exists.
    quiet = UnloadedBufferFilter(derived_only_layers(model))
    logger.addFilter(quiet)
    return quiet


class RefitWorkerExtension:
    """Methods vLLM adds to its worker (``LLM(worker_extension_cls=<qualified name>)``):
    `init_refit_group` once, `refit_from_group` per refit; ``self`` is vLLM's worker."""

    # Control messages go through vLLM's collective_rpc, data through the private group, as vLLM
    # advises.

    _refit_pg: Any = None

    def init_refit_group(self, host: str, port: int, timeout_s: float, owner_pid: int) -> int:
        """Join the trainer's private group (rank 1) on its store at ``host:port``; end with the
        owner ``owner_pid`` (`watch_owner`). Returns this worker's pid."""
        # the owner names the returned pid when the worker dies
        watch_owner(owner_pid)
        quiet_unloaded_buffers(self.model_runner.get_model())  # type: ignore[attr-defined]
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timeout)
        self._refit_pg = refit_group(store, WORKER, timeout, self._refit_device())
        return os.getpid()

    def refit_from_group(self) -> int:
        """Reload every weight in place from the trainer's stream; the number of tensors received.

        Raises:
            RuntimeError: the group was not set up; vLLM's reload failed (after the stream)."""
        if self._refit_pg is None:
            raise RuntimeError("refit_from_group: init_refit_group was not called.")
        device = self._refit_device()
        stream = receive_weights(self._refit_pg, device)
        received = 0

        def counted() -> Iterator[tuple[str, Tensor]]:
            nonlocal received
            for pair in stream:
                received += 1
                yield pair

        # vLLM's layerwise in-place reload maps HF names onto its fused layers and repacks the
        # weights for its CPU kernels; per-parameter load_weights into an already repacked CPU
        # model fails
        try:
            self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        except Exception as error:
            for _ in counted():  # drain: the trainer's sends must complete
                pass
            raise RuntimeError(f"vLLM's reload_weights failed: {error}") from error
        for _ in counted():  # names vLLM did not ask for (none for a whole model)
            pass
        return received

    def _refit_device(self) -> torch.device:
        device = getattr(self, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")


__all__ = [
    "EngineDiedError",
    "RefitWorkerExtension",
    "UnloadedBufferFilter",
    "derived_only_layers",
    "exit_status",
    "process_gone",
    "quiet_unloaded_buffers",
    "receive_weights",
    "refit_group",
    "send_weights",
    "watch_owner",
    "zombie_exitcode",
]
