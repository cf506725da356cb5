"""Leader election for the scaler's autoscaler: one Lease, acquired or renewed on a schedule.

The decisions are :mod:`protocol.scaling.lease`'s (``decide_lease``,
``release_lease``, and :class:`~protocol.scaling.lease.RenewSchedule` for
when the next round is due); this module performs them against a
:class:`~infx.scaling.kube.LeaseStore` and keeps one timer at the schedule's
deadline on the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from infx.deadline import DeadlineTimer
from infx.scaling.kube import LeaseStore, ScaleConflict
from protocol.scaling.lease import RenewSchedule, RoundDue, decide_lease, release_lease

__all__ = ["LeaseElector"]


class LeaseElector:
    """Leader election: acquire or renew a Lease every ``renew_interval`` on ``clock``.

    Leading ends as soon as a renewal fails or someone else holds an
    unexpired Lease; ``clock.seconds()`` must be wall-clock time, since the
    Lease's times are compared across gateways. ``on_change(leader)`` hears
    every change.
    """

    def __init__(self, clock: IReactorTime, store: LeaseStore, identity: str, name: str = "infx-scaler",
                 duration: float = 15.0, renew_interval: float = 5.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        # The namespace operators know, from before infx/scaling/ (a class-level Logger would take the new path).
        self.log = Logger(namespace="infx.scaler_lease.LeaseElector", source=self)
        self.clock = clock
        self.store = store
        self.identity = identity
        self.name = name
        self.duration = duration
        self.leader = False
        self._on_change = on_change
        self._schedule = RenewSchedule(renew_interval)
        self._timer = DeadlineTimer(clock, self._timeout)
        self._stopped = False

    def start(self) -> None:
        """Try now, then every renew interval."""
        self._stopped = False
        self._perform(self._schedule.start(self.clock.seconds()))

    def stop(self) -> defer.Deferred[None]:
        """Stop trying, and hand back a Lease we hold so that another
        gateway leads at its next round, not a Lease duration later."""
        self._stopped = True
        self._schedule.stop()
        self._timer.cancel()
        held = self.leader
        self._set(False)
        if not held:
            return defer.succeed(None)
        return defer.ensureDeferred(self._release())

    def _timeout(self) -> None:
        self._perform(self._schedule.handle_timeout(self.clock.seconds()))

    def _perform(self, effects: list[RoundDue]) -> None:
        for _ in effects:
            self.round().addBoth(self._round_done)
        self._timer.arm(self._schedule.next_deadline())

    def _round_done(self, _: Any) -> None:
        self._schedule.round_done(self.clock.seconds())
        self._timer.arm(self._schedule.next_deadline())

    async def _release(self) -> None:
        try:
            body = release_lease(await self.store.read(), self.identity, self.clock.seconds())
            if body is not None:
                await self.store.replace(body)
        except ScaleConflict:
            pass  # it changed hands meanwhile: nothing of ours to release
        except Exception:
            self.log.failure("releasing lease {name} failed", name=self.name)

    def is_leader(self) -> bool:
        """Whether this gateway leads right now."""
        return self.leader

    def round(self) -> defer.Deferred[None]:
        """One acquire-or-renew attempt."""
        return defer.ensureDeferred(self._round())

    async def _round(self) -> None:
        try:
            lease = await self.store.read()
            if self._stopped:
                return
            decision = decide_lease(lease, self.identity, self.name, self.duration, self.clock.seconds())
            if decision.body is not None:
                if decision.create:
                    await self.store.create(decision.body)
                else:
                    await self.store.replace(decision.body)
            if not self._stopped:
                self._set(decision.leader)
            elif decision.leader and decision.body is not None:
                await self._release()  # won just as we stopped
        except ScaleConflict:
            self._set(False)
        except Exception:
            self.log.failure("lease {name} round failed", name=self.name)
            self._set(False)

    def _set(self, leader: bool) -> None:
        if leader != self.leader:
            self.leader = leader
            self.log.info("{identity} {what} lease {name}", identity=self.identity, name=self.name,
                          what="now holds" if leader else "no longer holds")
            if self._on_change is not None:
                self._on_change(leader)
