"""A gRPC client channel's connectivity, redial backoff and transparent retry.

Rules this file keeps: no I/O, no clock reads, no randomness of its own
(``now`` is the last argument of every input, jitter is drawn from the
injected ``random.Random``); every input returns the effects the adapter must
perform; the machine says when it must be woken (``next_deadline()``) and
the adapter then calls ``handle_timeout(now)``.  Calls are opaque keys chosen
by the adapter; the machine never sees their bytes, only their sizes.

Connectivity follows grpc/grpc ``doc/connectivity-semantics-and-api.md``:

- IDLE: no connection; the first call (or a waiting one) dials (CONNECTING).
- CONNECTING -> READY when the connection is up; waiting calls start.
- CONNECTING -> TRANSIENT_FAILURE when the dial fails: waiting calls fail
  UNAVAILABLE unless ``wait_for_ready``; the redial is due after the
  backoff of ``doc/connection-backoff.md`` (:mod:`protocol.backoff`).
- READY -> IDLE when the connection takes no more calls (GOAWAY, closed);
  it redials at once if calls wait.
- any -> SHUTDOWN on ``close``: waiting calls fail, nothing dials again.

Transparent retry (gRFC A6, "transparent retries"): a
call the server never processed (refused by GOAWAY or REFUSED_STREAM) is
started again, ahead of calls not yet started, while everything it sent is
still within the retry buffer, no response headers came, attempts remain and
its deadline has not passed.
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.backoff import GRPC_CONNECTION_BACKOFF, Backoff
from protocol.errors import LocalUsageError
from protocol.grpc.metadata import StatusCode

__all__ = [
    "AttachWaiting", "CancelConnect", "ChannelEffect", "ChannelMachine", "ChannelState",
    "ChannelUsageError", "CloseConnection", "Connect", "FailCall", "MAX_ATTEMPTS",
    "ReleaseRetryBuffer", "RETRY_BUFFER_LIMIT", "RetryCall",
]

#: Bytes of requests a call keeps for a transparent retry (grpc-core's
#: default retry buffer); a call that sent more is not retried.
RETRY_BUFFER_LIMIT = 256 * 1024
#: Attempts of one call, counting the first, when streams are refused.
MAX_ATTEMPTS = 5

K = TypeVar("K")


class ChannelState(enum.Enum):
    """Connectivity, as grpc/grpc ``doc/connectivity-semantics-and-api.md``."""

    IDLE = "idle"
    CONNECTING = "connecting"
    READY = "ready"
    TRANSIENT_FAILURE = "transient-failure"
    SHUTDOWN = "shutdown"


class ChannelUsageError(LocalUsageError):
    """The adapter fed an input that does not fit (a call it never opened,
    a dial outcome while none was asked for)."""


@dataclass(frozen=True)
class Connect:
    """Dial the address now."""


@dataclass(frozen=True)
class CancelConnect:
    """Abandon the dial under way."""


@dataclass(frozen=True)
class CloseConnection:
    """Close the connection the input was about (after what it already wrote)."""


@dataclass(frozen=True)
class AttachWaiting:
    """The connection can take calls: open the streams of :attr:`ChannelMachine.waiting`,
    oldest first, telling the machine ``call_attached`` for each, until one does not fit."""


@dataclass(frozen=True)
class FailCall(Generic[K]):
    """End ``call`` with this status without it reaching the wire."""

    call: K
    code: StatusCode
    message: str


@dataclass(frozen=True)
class RetryCall(Generic[K]):
    """``call`` was refused unseen: drop its stream and replay its retry buffer
    on the next attach (it is queued ahead of the other waiting calls)."""

    call: K


@dataclass(frozen=True)
class ReleaseRetryBuffer(Generic[K]):
    """``call`` can no longer be retried: drop the copy of what it sent."""

    call: K


ChannelEffect = Connect | CancelConnect | CloseConnection | AttachWaiting | FailCall[K] \
    | RetryCall[K] | ReleaseRetryBuffer[K]


class _Retry:
    """What decides whether one call may still be retried."""

    __slots__ = ("attempts", "buffered", "committed", "deadline", "wait_for_ready", "waiting")

    def __init__(self, deadline: float | None, wait_for_ready: bool) -> None:
        self.waiting = False
        self.attempts = 1
        self.buffered = 0
        self.committed = False
        self.deadline = deadline
        self.wait_for_ready = wait_for_ready


class ChannelMachine(Generic[K]):
    """Connectivity, backoff, the waiting queue and retry eligibility of one channel."""

    def __init__(self, rng: random.Random, backoff: Backoff = GRPC_CONNECTION_BACKOFF,
                 *, retry_buffer_limit: int = RETRY_BUFFER_LIMIT,
                 max_attempts: int = MAX_ATTEMPTS) -> None:
        self.state = ChannelState.IDLE
        self._rng = rng
        self._backoff = backoff
        self._retry_buffer_limit = retry_buffer_limit
        self._max_attempts = max_attempts
        self._failures = 0
        self._redial_at: float | None = None
        self._calls: dict[K, _Retry] = {}
        self._waiting: deque[K] = deque()
        # (deadline, sequence, call) of waiting calls; stale entries are skipped.
        self._deadlines: list[tuple[float, int, K]] = []
        self._sequence = 0

    # -- queries -----------------------------------------------------------------

    @property
    def waiting(self) -> tuple[K, ...]:
        """Calls waiting for a stream, in the order they are to start."""
        return tuple(self._waiting)

    def next_deadline(self) -> float | None:
        """When ``handle_timeout`` must run: the redial, or a waiting call's deadline."""
        self._drop_stale_deadlines()
        redial = self._redial_at
        if not self._deadlines:
            return redial
        first = self._deadlines[0][0]
        return first if redial is None or first < redial else redial

    # -- calls -------------------------------------------------------------------

    def call_opened(self, call: K, deadline: float | None, wait_for_ready: bool,
                    now: float) -> list[ChannelEffect[K]]:
        """The application started ``call`` (``deadline``: clock time or None)."""
        if call in self._calls:
            raise ChannelUsageError(f"call {call!r} is already open")
        if self.state is ChannelState.SHUTDOWN:
            return [FailCall(call, StatusCode.UNAVAILABLE, "channel closed")]
        if self.state is ChannelState.TRANSIENT_FAILURE and not wait_for_ready:
            return [FailCall(call, StatusCode.UNAVAILABLE, "not connected")]
        self._calls[call] = _Retry(deadline, wait_for_ready)
        return self._enqueue(call, now, first=False)

    def call_attached(self, call: K, now: float) -> list[ChannelEffect[K]]:
        """``call``'s stream is open on the connection: it waits no more."""
        retry = self._retry_of(call)
        if not retry.waiting:
            raise ChannelUsageError(f"call {call!r} is not waiting")
        self._unqueue(call, retry)
        return []

    def message_queued(self, call: K, size: int, now: float) -> list[ChannelEffect[K]]:
        """``call`` sent a message of ``size`` bytes (kept for a retry while it fits)."""
        retry = self._retry_of(call)
        if retry.committed:
            return []
        retry.buffered += size
        if retry.buffered > self._retry_buffer_limit:
            return self._commit(call, retry)
        return []

    def response_started(self, call: K, now: float) -> list[ChannelEffect[K]]:
        """The server answered ``call`` (headers): it was seen, so never retried."""
        retry = self._retry_of(call)
        return [] if retry.committed else self._commit(call, retry)

    def call_refused(self, call: K, now: float) -> list[ChannelEffect[K]]:
        """The server refused ``call`` unprocessed (GOAWAY or REFUSED_STREAM):
        retried transparently if it still may be, else the adapter ends it with
        the refusal's status (no effect for it)."""
        retry = self._retry_of(call)
        if (retry.committed or retry.attempts >= self._max_attempts
                or (retry.deadline is not None and retry.deadline <= now)):
            return []
        retry.attempts += 1
        effects: list[ChannelEffect[K]] = [RetryCall(call)]
        effects += self._enqueue(call, now, first=True)
        return effects

    def call_finished(self, call: K, now: float) -> list[ChannelEffect[K]]:
        """``call`` ended (for any reason): forget it; a freed stream may let a
        waiting call start."""
        retry = self._calls.pop(call, None)
        if retry is None:
            return []
        if retry.waiting:
            self._unqueue(call, retry)
            return []
        if self._waiting and self.state is ChannelState.READY:
            return [AttachWaiting()]
        return []

    # -- the connection ------------------------------------------------------------

    def connect_succeeded(self, now: float) -> list[ChannelEffect[K]]:
        """The dial produced a connection ready for calls."""
        if self.state is ChannelState.SHUTDOWN:
            return [CloseConnection()]
        self._expect(ChannelState.CONNECTING, "connect_succeeded")
        self.state = ChannelState.READY
        self._failures = 0
        return [AttachWaiting()] if self._waiting else []

    def connect_failed(self, reason: str, now: float) -> list[ChannelEffect[K]]:
        """The dial failed: non-waiting-for-ready calls fail, the redial is due later."""
        if self.state is ChannelState.SHUTDOWN:
            return []
        self._expect(ChannelState.CONNECTING, "connect_failed")
        self.state = ChannelState.TRANSIENT_FAILURE
        effects: list[ChannelEffect[K]] = []
        for call in [c for c in self._waiting if not self._calls[c].wait_for_ready]:
            self._unqueue(call, self._calls[call])
            effects.append(FailCall(call, StatusCode.UNAVAILABLE, f"connect failed: {reason}"))
        self._failures += 1
        self._redial_at = now + self._backoff.delay(self._failures, self._rng.random())
        return effects

    def connection_ended(self, now: float) -> list[ChannelEffect[K]]:
        """The connection takes no more calls (GOAWAY received, or closed)."""
        if self.state is ChannelState.SHUTDOWN:
            return []
        self._expect(ChannelState.READY, "connection_ended")
        self.state = ChannelState.IDLE
        return self._dial() if self._waiting else []

    def close(self, now: float) -> list[ChannelEffect[K]]:
        """Shut the channel down: waiting calls fail, any dial is abandoned."""
        previous = self.state
        self.state = ChannelState.SHUTDOWN
        self._redial_at = None
        effects: list[ChannelEffect[K]] = []
        if previous is ChannelState.CONNECTING:
            effects.append(CancelConnect())
        while self._waiting:
            call = self._waiting[0]
            self._unqueue(call, self._calls[call])
            effects.append(FailCall(call, StatusCode.UNAVAILABLE, "channel closed"))
        self._deadlines = []
        if previous is ChannelState.READY:
            effects.append(CloseConnection())
        return effects

    def handle_timeout(self, now: float) -> list[ChannelEffect[K]]:
        """Fail waiting calls whose deadline passed; redial when the backoff is over."""
        effects: list[ChannelEffect[K]] = []
        self._drop_stale_deadlines()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, call = heapq.heappop(self._deadlines)
            retry = self._calls.get(call)
            if retry is not None and retry.waiting:
                self._unqueue(call, retry)
                effects.append(FailCall(call, StatusCode.DEADLINE_EXCEEDED,
                                        "deadline exceeded while waiting for a connection"))
            self._drop_stale_deadlines()
        if self._redial_at is not None and self._redial_at <= now:
            self._redial_at = None
            if self.state is ChannelState.TRANSIENT_FAILURE:
                effects += self._dial()
        return effects

    # -- internals -----------------------------------------------------------------

    def _retry_of(self, call: K) -> _Retry:
        retry = self._calls.get(call)
        if retry is None:
            raise ChannelUsageError(f"call {call!r} is not open")
        return retry

    def _expect(self, state: ChannelState, what: str) -> None:
        if self.state is not state:
            raise ChannelUsageError(f"{what} while {self.state.value}")

    def _commit(self, call: K, retry: _Retry) -> list[ChannelEffect[K]]:
        retry.committed = True
        return [ReleaseRetryBuffer(call)]

    def _unqueue(self, call: K, retry: _Retry) -> None:
        retry.waiting = False
        if self._waiting[0] == call:
            self._waiting.popleft()
        else:
            self._waiting.remove(call)

    def _enqueue(self, call: K, now: float, *, first: bool) -> list[ChannelEffect[K]]:
        self._calls[call].waiting = True
        if first:
            self._waiting.appendleft(call)
        else:
            self._waiting.append(call)
        deadline = self._calls[call].deadline
        if deadline is not None:
            self._sequence += 1
            heapq.heappush(self._deadlines, (deadline, self._sequence, call))
        if self.state is ChannelState.IDLE:
            return self._dial()
        if self.state is ChannelState.READY and (first or len(self._waiting) == 1):
            return [AttachWaiting()]
        return []

    def _dial(self) -> list[ChannelEffect[K]]:
        self.state = ChannelState.CONNECTING
        return [Connect()]

    def _drop_stale_deadlines(self) -> None:
        deadlines, calls = self._deadlines, self._calls
        while deadlines:
            retry = calls.get(deadlines[0][2])
            if retry is not None and retry.waiting:
                return
            heapq.heappop(deadlines)
