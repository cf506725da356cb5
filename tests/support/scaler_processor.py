"""A result sink and an engine route recorded in memory, for tests of the processor with its scaler."""

from __future__ import annotations

from typing import Any

from twisted.internet import task

from infx.gateway.dispatcher import SendOutcome


class Sink:
    def __init__(self) -> None:
        self.status: int | None = None
        self.failure: tuple[int, str, float | None] | None = None

    def response_received(self, response: Any, verbatim: bool = False) -> None:
        self.status = response.status_code

    def event_received(self, data: bytes) -> None:
        pass

    def completed(self) -> None:
        pass

    def failed(self, status: int, message: str, retry_after: float | None, code: str | None = None,
               detail: str = "") -> None:
        self.failure = (status, message, retry_after)


class Route:
    """An engine stream: records tasks sent to it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_task(self, task: Any, tenant_id: str) -> SendOutcome:
        self.sent.append(task)
        return SendOutcome.SENT

    def withdraw_task(self, wire_id: str) -> bool:
        return False  # a task sent here is never left queued

    def close(self, reason: str) -> None:
        pass
