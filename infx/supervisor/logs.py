"""How a worker's log events reach the supervisor's log, and say which worker they come from.

Two ways, chosen by the supervisor from twistd's own logging:

- ``twistd -n`` logging text to standard output (the default in the foreground, in a
  container): each worker writes its lines itself to the standard output it inherited,
  in twistd's own format, ``{time} [worker-N {namespace}#{level}] {text}``. Nothing passes
  through the supervisor, so a request's log line costs no more than in one process.
- anything else (``--logfile``, a daemon's ``twistd.log``, ``--logger``, ``--syslog``):
  each worker writes its events as JSON lines (twisted.logger's own format) to a pipe,
  and the supervisor publishes them as its own events, with ``worker`` and the same
  system, so that one log file (and its rotation) or one observer sees every worker.

Either way a timestamp is formatted once per second, not once per line (the time-zone
arithmetic of twisted.logger's ``formatTime`` was a visible share of a request's cost).
"""

from __future__ import annotations

from typing import IO, Any

from twisted.logger import FileLogObserver, formatEventAsClassicLogText, formatTime

__all__ = ["CachedTime", "text_observer", "worker_system"]


def worker_system(index: int, event: dict[str, Any]) -> str:
    """The ``[system]`` of worker ``index``'s event: ``worker-N`` before what twistd would print."""
    system = event.get("log_system")
    if system is None or system == "-":
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{getattr(level, 'name', '-')}"
    return f"worker-{index} {system}"


class CachedTime:
    """twisted.logger's ``formatTime`` (RFC 3339, to the second), computed once per second."""

    def __init__(self) -> None:
        self._second: int | None = None
        self._text = "-"

    def __call__(self, when: float | None) -> str:
        if when is None:
            return "-"
        second = int(when)
        if second != self._second:
            self._second = second
            self._text = formatTime(second)
        return self._text


def text_observer(out: IO[str], index: int) -> FileLogObserver:
    """Worker ``index``'s events as twistd's text lines on ``out``."""
    cached = CachedTime()

    def line(event: dict[str, Any]) -> str | None:
        event["log_system"] = worker_system(index, event)
        return formatEventAsClassicLogText(event, formatTime=cached)

    return FileLogObserver(out, line)
