"""One traceback per run: when every rank raises, rank 0 prints the traceback and each other rank
one line pointing to it (instead of one 100-line traceback per rank, interleaved).

``lmrl`` installs :func:`install_rank_excepthook` at start and ``MCoreRLStrategy`` in its
``setup_environment`` (any script); a script can call it earlier for errors before ``fit``. ``LMRL_ALL_TRACEBACKS=1`` prints every rank's traceback (for an error of one rank only); an
error that is one rank's own (:func:`is_rank_local`, e.g. a collective that failed because a
peer died) is printed in full on every rank that raises it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

ALL_TRACEBACKS_ENV = "LMRL_ALL_TRACEBACKS"
"""Set to ``1`` to print the full traceback on every rank."""


def current_rank() -> int:
    """This process's global rank: torch.distributed's once initialised, else Lightning's (from
    ``RANK``/``LOCAL_RANK``/SLURM environment variables; 0 in a single process)."""
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
    """Whether ``error`` is one rank's own (e.g. a collective that failed because a peer died:
    ``rank_local = True`` on its class); its traceback is printed on every rank."""
    return bool(getattr(error, "rank_local", False))


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class RankExceptHook:
    """A ``sys.excepthook`` that calls ``previous`` on rank 0 (or on every rank with
    ``LMRL_ALL_TRACEBACKS=1``, or for a :func:`is_rank_local` error) and prints
    :func:`pointer_line` on the other ranks.

    Args:
        previous: the hook that prints tracebacks (the one installed before).
    """

    def __init__(self, previous: ExceptHook) -> None:
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], error: BaseException, traceback: TracebackType | None
    ) -> None:
        rank = current_rank()
        everywhere = os.environ.get(ALL_TRACEBACKS_ENV) == "1" or is_rank_local(error)
        if rank == 0 or everywhere:
            self.previous(kind, error, traceback)
            return
        print(pointer_line(rank, error), file=sys.stderr, flush=True)


def install_rank_excepthook() -> None:
    """Print uncaught exceptions once per run (see the module docstring): wraps the current
    ``sys.excepthook`` in a :class:`RankExceptHook` (idempotent)."""
    if not isinstance(sys.excepthook, RankExceptHook):
        sys.excepthook = RankExceptHook(sys.excepthook)
