"""Leader election over a coordination.k8s.io/v1 Lease: pure decisions, no I/O, no clock reads.

Rules this file keeps: time is a ``now`` argument (seconds since the epoch,
because a Lease stores wall-clock MicroTimes other gateways compare); a
decision is a value (the Lease body to create or replace, or nothing); the
caller performs it with the ``resourceVersion`` it read, so two candidates
cannot both win (the loser gets 409 and stays a follower).
"""

from __future__ import annotations

import copy
import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_MICRO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def micro_time(seconds: float) -> str:
    """A Kubernetes MicroTime for ``seconds`` since the epoch."""
    return _dt.datetime.fromtimestamp(seconds, _dt.timezone.utc).strftime(_MICRO_FORMAT)


def parse_micro_time(text: str | None) -> float | None:
    """Seconds since the epoch of a MicroTime or RFC 3339 time, or None if unreadable.

    Servers and clients spell the zone ``Z`` or ``+00:00``; a time without a
    zone is taken as UTC. Misreading one would make every gateway think the
    Lease expired and take it over.
    """
    if not text:
        return None
    try:
        parsed = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=_dt.timezone.utc)
    return parsed.timestamp()


@dataclass(frozen=True)
class LeaseDecision:
    """What to do with the Lease this round.

    ``body`` is None to leave it alone; otherwise create it (``create``) or
    replace it (the body carries the resourceVersion read). ``leader`` is
    whether we lead once the write succeeds (or now, when nothing is written).
    """

    leader: bool
    body: dict[str, Any] | None
    create: bool = False


def decide_lease(lease: Mapping[str, Any] | None, identity: str, name: str, duration: float,
                 now: float) -> LeaseDecision:
    """Acquire, renew or respect the Lease ``lease`` (None when it does not exist)."""
    if lease is None:
        return LeaseDecision(True, {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name},
            "spec": {"holderIdentity": identity, "leaseDurationSeconds": max(1, round(duration)),
                     "acquireTime": micro_time(now), "renewTime": micro_time(now),
                     "leaseTransitions": 0},
        }, create=True)
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    renewed = parse_micro_time(spec.get("renewTime")) or parse_micro_time(spec.get("acquireTime"))
    held_for = float(spec.get("leaseDurationSeconds") or duration)
    expired = renewed is None or now >= renewed + held_for
    if holder and holder != identity and not expired:
        return LeaseDecision(False, None)
    body = copy.deepcopy(dict(lease))
    new_spec = body.setdefault("spec", {})
    if holder != identity:
        new_spec["acquireTime"] = micro_time(now)
        new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if holder else 0)
    new_spec["holderIdentity"] = identity
    new_spec["leaseDurationSeconds"] = max(1, round(duration))
    new_spec["renewTime"] = micro_time(now)
    return LeaseDecision(True, body)


def release_lease(lease: Mapping[str, Any] | None, identity: str, now: float) -> dict[str, Any] | None:
    """The body that hands back ``lease`` if we hold it (else None).

    As client-go's ReleaseOnCancel: no holder and a one-second duration,
    renewed now, so that another gateway leads at its next round instead of
    waiting out the full duration of a Lease nobody renews.
    """
    if lease is None:
        return None
    if (lease.get("spec") or {}).get("holderIdentity") != identity:
        return None
    body = copy.deepcopy(dict(lease))
    spec = body.setdefault("spec", {})
    spec["holderIdentity"] = ""
    spec["leaseDurationSeconds"] = 1
    spec["acquireTime"] = spec["renewTime"] = micro_time(now)
    return body


@dataclass(frozen=True)
class RoundDue:
    """Begin one acquire-or-renew round now; report its end with :meth:`RenewSchedule.round_done`."""


class RenewSchedule:
    """When the elector's next round is due: at :meth:`start`, then every ``interval`` seconds.

    Rounds never overlap: one that falls due while another is out waits for
    it, and intervals missed meanwhile are skipped, not caught up on (as a
    ``LoopingCall`` would).
    """

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("the renew interval must be positive")
        self.interval = interval
        self._due: float | None = None
        self._out = False

    def start(self, now: float) -> list[RoundDue]:
        """Begin: the first round is due at once."""
        self._due = now
        return self.handle_timeout(now)

    def stop(self) -> None:
        """No more rounds (one still out ends on its own)."""
        self._due = None

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must run (None while stopped or while a round is out)."""
        return None if self._out else self._due

    def handle_timeout(self, now: float) -> list[RoundDue]:
        """A round, if one is due and none is out."""
        if self._due is None or self._out or now < self._due:
            return []
        self._out = True
        while self._due <= now:
            self._due += self.interval
        return [RoundDue()]

    def round_done(self, now: float) -> None:
        """The round that was out ended; the next is due at the schedule's next time after ``now``."""
        self._out = False
        if self._due is not None:
            while self._due <= now:
                self._due += self.interval
