"""Log events of the infx modules captured while a block runs, for tests that read log lines."""

from __future__ import annotations

from typing import Any

from twisted.logger import formatEvent, globalLogPublisher


class LogLines:
    """Every log event of the infx modules while it is open, formatted."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> LogLines:
        globalLogPublisher.addObserver(self._observe)
        return self

    def __exit__(self, *exc: Any) -> None:
        globalLogPublisher.removeObserver(self._observe)

    def _observe(self, event: dict[str, Any]) -> None:
        if str(event.get("log_namespace", "")).startswith("infx."):
            self.events.append(event)

    def matching(self, text: str) -> list[str]:
        return [line for line in (formatEvent(e) for e in self.events) if text in line]
