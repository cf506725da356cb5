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
        self._ring: deque[RequestRecord] = deque()
        self._failures: deque[RequestRecord] = deque()
        # The newest record of each id still in either ring, and how many rings hold each record
        # (by ``id()``: a record is alive while a ring holds it).
        self._by_id: dict[str, RequestRecord] = {}
        self._holders: Counter[int] = Counter()
        #: Requests refused by their key's rate limit since start, per tenant.
        self.rate_limited: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, record: RequestRecord) -> None:
        """``record``'s request ended: remember it, forgetting the oldest beyond the bounds."""
        if record.error == RATE_LIMITED:
            self.rate_limited[record.tenant] += 1
        self._push(self._ring, record, self.config.requests)
        if record.failed:
            self._push(self._failures, record, self.config.failures)
        if record.request_id:
            self._by_id[record.request_id] = record

    def _push(self, ring: deque[RequestRecord], record: RequestRecord, bound: int) -> None:
        ring.append(record)
        self._holders[id(record)] += 1
        while len(ring) > bound:
            old = ring.popleft()
            self._holders[id(old)] -= 1
            if self._holders[id(old)] > 0:
                continue  # a failure still in the other ring
            del self._holders[id(old)]
            if self._by_id.get(old.request_id) is old:
                del self._by_id[old.request_id]

    def find(self, request_id: str, tenant: str | None = None) -> RequestRecord | None:
        """The newest request of that id still remembered; with ``tenant``, only that tenant's."""
        record = self._by_id.get(request_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            return None
        return record

    def failures(self, tenant: str | None = None, limit: int | None = None) -> list[RequestRecord]:
        """The last failures, newest first; with ``tenant``, that tenant's alone."""
        out: list[RequestRecord] = []
        for record in reversed(self._failures):
            if tenant is None or record.tenant == tenant:
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out
