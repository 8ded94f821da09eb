"""One traceback per run: when every rank raises, rank 0 prints the traceback and each other rank
one line pointing to it (`LMRL_ALL_TRACEBACKS=1`: every rank's)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

ALL_TRACEBACKS_ENV = "LMRL_ALL_TRACEBACKS"
"""Set to ``1`` to print the full traceback on every rank."""


def current_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else Lightning's (from the
    environment; 0 in a single process)."""
    import torch.distributed as dist
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def pointer_line(rank: int, error: BaseException) -> str:
    """The one line a non-zero rank prints instead of its traceback."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"rank {rank}: {type(error).__name__}: {first} — see rank 0's traceback "
        f"({ALL_TRACEBACKS_ENV}=1 prints every rank's)"
    )


def is_rank_local(error: BaseException) -> bool:
    """Whether `error` is one rank's own (`rank_local = True` on its class, e.g. a collective that
    failed because a peer died); its traceback is printed on every rank."""
    return bool(getattr(error, "rank_local", False))


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class RankExceptHook:
    """A `sys.excepthook` that calls `previous` (the hook installed before) on rank 0, on every rank
    with `LMRL_ALL_TRACEBACKS=1` or for an `is_rank_local` error, and prints `pointer_line` on the
    other ranks."""

    def __init__(self, previous: ExceptHook) -> None:
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], error: BaseException, traceback: TracebackType | None
    ) -> None:
        rank = current_rank()
        # instead of one long traceback per rank, interleaved; a rank-local error differs per rank,
        # so each prints its own
        everywhere = os.environ.get(ALL_TRACEBACKS_ENV) == "1" or is_rank_local(error)
        if rank == 0 or everywhere:
            self.previous(kind, error, traceback)
            return
        print(pointer_line(rank, error), file=sys.stderr, flush=True)


def install_rank_excepthook() -> None:
    """Wrap the current `sys.excepthook` in a `RankExceptHook` (idempotent)."""
    # `lmrl` installs it at start and `MCoreRLStrategy` in `setup_environment` (any script); a
    # script can call it earlier for errors before `fit`
    if not isinstance(sys.excepthook, RankExceptHook):
        sys.excepthook = RankExceptHook(sys.excepthook)
