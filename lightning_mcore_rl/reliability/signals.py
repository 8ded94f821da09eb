"""SIGTERM to any one rank stops every rank at the same step, with a saved ``last`` and a non-zero
exit code.

Lightning 2.6's SIGTERM handler runs a ``broadcast`` on the default group INSIDE the signal
handler, wherever the main thread is: on a rank signalled alone (SIGTERM to rank 1) it waits in
that broadcast while its peers wait in a TP all-reduce (a deadlock until the timeout); a rank
that leaves after it raises ``SIGTERMException``, a ``SystemExit`` whose code is 0.

:class:`TerminationRequest` takes SIGTERM over while ``fit`` trains (installed at
``on_train_start``, the previous handler restored after): the handler only records the signal.
Every rank agrees on it in the first agreement collective of each training step (its ``signal``
column, MAX over the strategy's world group:
:class:`~lightning_mcore_rl.reliability.agreement.StepBoundary`; no collective of its own); once
agreed, every rank calls the previous (Lightning's) handler at that same point, so its broadcast
is matched on every rank and Lightning ends the step normally and raises ``SIGTERMException`` at
the step's end, on every rank. The strategy's ``on_exception`` then saves ``last`` (a
collective, every rank is there) and sets the exit code to ``128 + signum`` (143).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

TERMINATING_SIGNALS = (signal.SIGTERM,)
"""The signals handled at a step boundary."""


class TerminationRequest:
    """A SIGTERM noted on this rank and, after :meth:`act` (with the agreed signal), on every
    rank."""

    def __init__(self) -> None:
        self.received: int | None = None  # the signal number this rank received
        self.agreed: int | None = None  # the signal number every rank acts on
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle :data:`TERMINATING_SIGNALS` by recording them (main thread only: Python's
        signal handlers are set there; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in TERMINATING_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def act(self, signum: int) -> int | None:
        """The signal every rank agreed on (``0``: none; the MAX over ranks of
        :attr:`received`, from the step's agreement collective). The first time one is agreed,
        call the previous handler here, on every rank at once (Lightning's: it forwards the
        signal to the processes it launched and ends the training step with
        ``SIGTERMException``).

        Returns:
            The agreed signal number (this one or an earlier one), or None.
        """
        if self.agreed is not None or signum == 0:
            return self.agreed
        self.agreed = signum
        handler = self._previous.get(signum)
        if callable(handler):
            handler(signum, None)
        return signum


__all__ = ["TERMINATING_SIGNALS", "TerminationRequest"]
