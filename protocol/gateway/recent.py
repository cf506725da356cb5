"""The gateway's memory of its recent requests: a bounded ring searchable by request id.

Rules this file keeps: no I/O, no clock reads (every time is a value the
caller took). Memory is bounded by :class:`RecentConfig` whatever the
traffic: the last ``requests`` requests that ended, and apart from them the
last ``failures`` that ended in an error, so that a burst of successes does
not push the failures an operator looks for out of sight.

Each :class:`RequestRecord` is what the request log's line says of one
request (``infx/http/request_log.py`` makes it when the request ends): who
asked, for what, the route it took (this gateway, the peer whose engine
served it, the engine), its wait in the queue, its retries and how it ended.
The operator page's search by request id reads it (``/admin/status?request=ID``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

__all__ = ["RATE_LIMITED", "RecentConfig", "RecentRequests", "RequestRecord"]

#: The error code of a request refused by its key's rate limit.
RATE_LIMITED = "rate_limit_exceeded"


@dataclass(frozen=True, slots=True)
class RecentConfig:
    """How much the gateway remembers: requests that ended, and failures apart from them."""

    requests: int = 2000
    failures: int = 100

    def __post_init__(self) -> None:
        if self.requests < 1 or self.failures < 1:
            raise ValueError("requests and failures must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request that ended, as its log line says it (times on the gateway's clock)."""

    request_id: str
    tenant: str
    endpoint: str
    #: The model the client named (bounded by nothing: shown, never a label).
    model: str
    started_at: float
    ended_at: float
    #: How it ended, as the log line's ``status`` (499: the client went first).
    status: int
    #: For an error: its OpenAI code or type, and what broke in the words of the layer that saw it.
    error: str = ""
    detail: str = ""
    #: The gateway whose engine served it (this one or a peer), and that engine's id there.
    served_by: str = ""
    engine_id: str = ""
    #: Sends to an engine after a failed one.
    retries: int = 0
    queued_seconds: float | None = None
    first_token_seconds: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None

    @property
    def failed(self) -> bool:
        """Whether it ended in an error (any status from 400, a client's own 499 included)."""
        return self.status >= 400


class RecentRequests:
    """The last requests that ended, by id, and the last failures among them."""

    def __init__(self, config: RecentConfig | None = None) -> None:
        self.config = config or RecentConfig()
        # (sequence, record), oldest first: every record is numbered as it comes, so that which ring
        # still holds a record is one comparison with the oldest number each ring holds.
        self._ring: deque[tuple[int, RequestRecord]] = deque()
        self._failures: deque[tuple[int, RequestRecord]] = deque()
        self._sequence = 0
        # The newest record of each id still in either ring, with its number.
        self._by_id: dict[str, tuple[int, RequestRecord]] = {}
        #: Requests refused by their key's rate limit since start, per tenant.
        self.rate_limited: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, record: RequestRecord) -> None:
        """``record``'s request ended: remember it, forgetting the oldest beyond the bounds."""
        if record.error == RATE_LIMITED:
            self.rate_limited[record.tenant] += 1
        self._sequence += 1
        entry = (self._sequence, record)
        if record.request_id:
            self._by_id[record.request_id] = entry
        self._ring.append(entry)
        if len(self._ring) > self.config.requests:
            self._forget(self._ring.popleft(), self._failures)
        if record.failed:
            self._failures.append(entry)
            if len(self._failures) > self.config.failures:
                self._forget(self._failures.popleft(), self._ring)

    def _forget(self, entry: tuple[int, RequestRecord], other: deque[tuple[int, RequestRecord]]) -> None:
        """``entry`` left one ring: its id is forgotten unless the other ring still holds it (every
        entry of a ring from its oldest on is still there) or a newer record took the id."""
        sequence, record = entry
        if other and other[0][0] <= sequence and (other is self._ring or record.failed):
            return
        if self._by_id.get(record.request_id) is entry:
            del self._by_id[record.request_id]

    def find(self, request_id: str, tenant: str | None = None) -> RequestRecord | None:
        """The newest request of that id still remembered; with ``tenant``, only that tenant's."""
        entry = self._by_id.get(request_id)
        if entry is None or (tenant is not None and entry[1].tenant != tenant):
            return None
        return entry[1]

    def failures(self, tenant: str | None = None, limit: int | None = None) -> list[RequestRecord]:
        """The last failures, newest first; with ``tenant``, that tenant's alone."""
        out: list[RequestRecord] = []
        for _, record in reversed(self._failures):
            if tenant is None or record.tenant == tenant:
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out
