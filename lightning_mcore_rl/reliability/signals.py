"""SIGTERM to any one rank stops every rank at the same step, with a saved `last` and exit code
`128 + signum`: `TerminationRequest` records the signal, the step's agreement acts on it."""

# Lightning 2.6's SIGTERM handler runs a `broadcast` on the default group INSIDE the signal
# handler, wherever the main thread is: a rank signalled alone waits in that broadcast while its
# peers wait in a TP all-reduce (a deadlock until the timeout), and `SIGTERMException` exits 0.
# So while `fit` trains, the handler here only records the signal; every rank agrees on it in
# the first agreement collective of each training step (`agreement.StepBoundary`, the `signal`
# column, MAX over the world group) and calls Lightning's handler at that same point, so its
# broadcast is matched; the strategy's `on_exception` then saves `last` and sets the exit code.

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

TERMINATING_SIGNALS = (signal.SIGTERM,)
"""The signals handled at a step boundary."""


class TerminationRequest:
    """A SIGTERM noted on this rank and, after `act` (with the agreed signal), on every rank."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal number this rank received
        self.agreed: int | None = None  # the signal number every rank acts on
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle `TERMINATING_SIGNALS` by recording them (main thread only)."""
        # Python sets signal handlers in the main thread only: elsewhere nothing changes
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in TERMINATING_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def act(self, signum: int) -> int | None:
        """Act on `signum`, the MAX of `received` over ranks (`0`: none); returns the agreed
        signal number (this one or an earlier one), or None."""
        if self.agreed is not None or signum == 0:
            return self.agreed
        self.agreed = signum
        # the first agreed signal calls the previous (Lightning's) handler here, on every rank at
        # once: it forwards the signal to the processes it launched and ends the training step
        # with `SIGTERMException`
        handler = self._previous.get(signum)
        if callable(handler):
            handler(signum, None)
        return signum


__all__ = ["TERMINATING_SIGNALS", "TerminationRequest"]
