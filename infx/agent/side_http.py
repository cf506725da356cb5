"""The engine agent's side requests to its runtime (health checks, load scrapes).

They run on connection pools of their own, so that they never wait behind
busy task connections, and quietly: a pool's factory would otherwise log two
lines per connection the runtime closes between requests. Their answers are
small documents, read up to a cap so that a runtime cannot make the agent
buffer without bound.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool, ResponseDone, _HTTP11ClientFactory
from twisted.web.http import PotentialDataLoss

__all__ = ["CappedBody", "quiet_pool"]


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False


def quiet_pool(clock: IReactorTime, per_host: int) -> HTTPConnectionPool:
    """A persistent pool keeping ``per_host`` connections open, silent in the log."""
    pool = HTTPConnectionPool(clock, persistent=True)
    pool.maxPersistentPerHost = per_host
    pool._factory = _QuietFactory
    return pool


class CappedBody(Protocol):
    """Collects a body of up to ``limit`` bytes into ``done``.

    Past the limit the transfer is stopped; ``done`` then fires with what came
    (``truncate``: a health check needs only that the runtime answered) or fails
    (a metrics document cut short would be misread).
    """

    def __init__(self, done: Deferred[bytes], limit: int, truncate: bool) -> None:
        self._done = done
        self._limit = limit
        self._truncate = truncate
        self._chunks: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._limit:
            if self.transport is not None:
                self.transport.stopProducing()
            return
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        if self._done.called:
            return
        if self._size > self._limit and not self._truncate:
            self._done.errback(ValueError(f"body over {self._limit} bytes"))
        elif reason.check(ResponseDone, PotentialDataLoss) or self._size > self._limit:
            self._done.callback(b"".join(self._chunks))
        else:
            self._done.errback(reason)
