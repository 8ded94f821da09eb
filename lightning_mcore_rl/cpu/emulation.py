"""Scoped CPU emulation of the CUDA calls megatron-core makes, so its real schedules, DDP,
optimizers and `dist_checkpointing` run on CPU with gloo (`docs/cpu-emulation.md` maps every patch).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_mcore_rl._compat import (
    Patch,
    ScopedPatches,
    compat_patches,
    enter_megatron_compat,
    exit_megatron_compat,
)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device request (`"cuda"`, `"cuda:N"`, a cuda `torch.device`, an int) to CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placement (`device=`, `Tensor.cuda()`, `Tensor.to(cuda)`) to CPU and reports
    CPU tensors as CUDA types (no-argument `Tensor.type()`)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        # `device=` of any torch function: factories in megatron's DDP buffers, RNG tracker,
        # optimizer overflow buffers, p2p shape exchange
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        # `Tensor.cuda()` is a no-op: `Float16Module`, `get_batch` helpers, checkpoint loading
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        # "torch.cuda.FloatTensor" etc. for the asserts in `clip_grad_by_total_norm_fp32`,
        # `Float16OptimizerWithFloat16Params.__init__` and
        # `DistributedOptimizer._build_model_and_main_param_groups`
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        return func(*args, **kwargs)


class _DropRngWarning(logging.Filter):
    """Drops megatron's "CPU RNG state changed within GPU RNG context" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        # with CPU RNG == "CUDA" RNG, `CudaRNGStatesTracker.fork` warns on every fork: meaningless
        # here
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_manual_seed(seed: int) -> None:
    # Must not go through torch.manual_seed: that calls cuda.manual_seed_all again (recursion).
    torch.default_generator.manual_seed(int(seed))


def _get_cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


class _CpuStream:
    """The one "CUDA stream" of a CPU process (every construction returns it); waiting is a no-op."""

    # CPU work is synchronous: one stream object, and every wait is a no-op
    _instance: _CpuStream | None = None

    def __new__(cls, *_args: Any, **_kwargs: Any) -> _CpuStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, _other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self) -> _CpuStream:
        """An event that is already complete (it has the same `synchronize`)."""
        return self


def _current_stream(*_args: Any, **_kwargs: Any) -> _CpuStream:
    return _CpuStream()


def _stream_context(_stream: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """`moe_utils.maybe_move_tensor_to_cpu` for host tensors: `as_numpy` applies to them too."""
    # the original converts only CUDA tensors, so on CPU the all-to-all split sizes stayed tensors,
    # which `all_to_all_single` rejects
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _local_results_queue() -> queue.Queue:
    """Replaces `filesystem_async._get_write_results_queue` with an in-process queue."""
    # a synchronous save's results queue only lives inside this process; the original spawns a
    # multiprocessing Manager per save (and hangs when the main script has no `__main__` guard)
    return queue.Queue()


def _cpu_patches() -> list[Patch]:
    """The CPU attribute patches, each with the megatron-core call site that needs it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    patches = [
        # Device placement: `torch.cuda.current_device()` feeds `device=` in DDP param buffers,
        # p2p communication, the RNG tracker and the global memory buffer.
        Patch(torch.cuda, "current_device", lambda: "cpu"),
        # `torch.cuda.synchronize()` in timers/checkpointing, `empty_cache()` in DDP/optimizer.
        Patch(torch.cuda, "synchronize", _no_op),
        Patch(torch.cuda, "empty_cache", _no_op),
        # RNG: `CudaRNGStatesTracker.add` / `model_parallel_cuda_manual_seed` seed and read CUDA RNG.
        Patch(torch.cuda, "manual_seed", _cpu_manual_seed),
        Patch(torch.cuda, "manual_seed_all", _cpu_manual_seed),
        Patch(torch.cuda, "get_rng_state", _get_cpu_rng_state),
        Patch(torch.cuda, "set_rng_state", _set_cpu_rng_state),
        # `CudaRNGStatesTracker.add/fork` and activation checkpointing use these two directly.
        Patch(mcore_random, "_get_cuda_rng_state", _get_cpu_rng_state),
        Patch(mcore_random, "_set_cuda_rng_state", _set_cpu_rng_state),
        # `MoEAlltoAllTokenDispatcher.__init__` creates a device-to-host side stream and
        # `_maybe_dtoh_and_synchronize` compares it with the current stream and enters it: one
        # CPU stream object for both, so the splits move to the host on the calling thread.
        Patch(torch.cuda, "Stream", _CpuStream),
        Patch(torch.cuda, "current_stream", _current_stream),
        Patch(torch.cuda, "stream", _stream_context),
        # `_maybe_dtoh_and_synchronize`: the split sizes as host numbers (see _host_copy).
        Patch(token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        # `FileSystemWriterAsync.__init__` (sync `dist_checkpointing.save`): see _local_results_queue.
        Patch(filesystem_async, "_get_write_results_queue", _local_results_queue),
    ]
    if not filesystem_async.HAVE_PSUTIL:
        # `write_preloaded_data` raises in the forked writer without psutil -> the save hangs.
        patches.append(Patch(filesystem_async, "_process_memory", lambda: 0))
    return patches


class _EmulationState:
    """Process-wide install count: the outermost enter installs, the matching exit uninstalls."""

    def __init__(self) -> None:
        # entering twice (nested, or from two code paths) is harmless: only the outermost entry
        # installs the patches, `_compat`'s no-TE fixes and the mode, and only its exit uninstalls,
        # restoring every original object
        self.patches = ScopedPatches(_cpu_patches)
        self.mode: _CudaToCpuMode | None = None
        self.log_filter = _DropRngWarning()

    def install(self) -> None:
        with self.patches.lock:
            if not self.patches.enter():
                return
            enter_megatron_compat()
            logging.getLogger("megatron.core.tensor_parallel.random").addFilter(self.log_filter)
            self.mode = _CudaToCpuMode()
            self.mode.__enter__()

    def uninstall(self) -> None:
        with self.patches.lock:
            if not self.patches.exit():
                return
            assert self.mode is not None
            self.mode.__exit__(None, None, None)
            self.mode = None
            logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(self.log_filter)
            exit_megatron_compat()

    @property
    def active(self) -> bool:
        return self.patches.active


_STATE = _EmulationState()


@contextlib.contextmanager
def cpu_emulation() -> Iterator[None]:
    """Run megatron-core on CPU: CUDA placement goes to CPU, CUDA RNG is the CPU RNG, CUDA type
    checks pass, and the no-TE/Apex quirks of `_compat` are fixed. `torch.cuda.is_available()` stays
    `False`.

    Example::

    with cpu_emulation(): parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = GPTModel(...)  # megatron builds its buffers "on cuda" = on CPU
    """
    # the `TorchFunctionMode` is thread-local: threads started inside the block do not see it
    _STATE.install()
    try:
        yield
    finally:
        _STATE.uninstall()


def patched_attributes() -> list[tuple[Any, str]]:
    """`(owner, attribute)` of every attribute `cpu_emulation` replaces (for tests/docs)."""
    return [(patch.owner, patch.name) for patch in _cpu_patches() + compat_patches()]


def emulation_active() -> bool:
    """Whether `cpu_emulation` is installed in this process now."""
    return _STATE.active
