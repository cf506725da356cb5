"""One ``callLater`` kept at a pure machine's next deadline.

Every sans-IO machine in ``protocol/`` says when it must be woken
(``next_deadline()``); its Twisted owner keeps exactly one delayed call at
that time, moved only when the deadline moves, and cancelled on stop.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

__all__ = ["DeadlineTimer"]


class DeadlineTimer:
    """Calls ``fire()`` at the last deadline given to :meth:`arm` (None: never).

    ``early_ok``: the machine checks itself what is due when woken, so waking it early is
    harmless; then a later deadline keeps the call already armed for an earlier one (it
    fires, the machine does what is due, and the timer is armed again from its next
    deadline). A machine whose deadline moves later with nearly every input (the engine
    agent's: each task started or finished) then costs no delayed call per input.
    """

    def __init__(self, clock: IReactorTime, fire: Callable[[], None], *, early_ok: bool = False) -> None:
        self._clock = clock
        self._fire = fire
        self._early_ok = early_ok
        self._call: IDelayedCall | None = None
        self._at: float | None = None

    def arm(self, deadline: float | None) -> None:
        """Be due at ``deadline``; a deadline already armed costs nothing."""
        if deadline is not None and (deadline == self._at or (
                self._early_ok and self._at is not None and self._at < deadline)):
            return
        self.cancel()
        if deadline is not None:
            self._at = deadline
            self._call = self._clock.callLater(max(0.0, deadline - self._clock.seconds()), self._fired)

    def cancel(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = self._at = None

    def _fired(self) -> None:
        self._call = self._at = None
        self._fire()
