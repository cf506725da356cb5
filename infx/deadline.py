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
    """Calls ``fire()`` at the last deadline given to :meth:`arm` (None: never)."""

    def __init__(self, clock: IReactorTime, fire: Callable[[], None]) -> None:
        self._clock = clock
        self._fire = fire
        self._call: IDelayedCall | None = None
        self._at: float | None = None

    def arm(self, deadline: float | None) -> None:
        """Be due at ``deadline``; a deadline already armed costs nothing."""
        if deadline is not None and deadline == self._at:
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
