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

Written by the worker, a line costs less than twistd's own: its timestamp is formatted
once per second, not once per line, and an event whose format is ``{text}`` (the request
log's: its text is rendered where it is made) is not run through ``string.Formatter``
again. In a profile of one gateway at concurrency 32 (``tools/bench/http_bench.py
--profile``), twistd's file observer took 5 % of the gateway's CPU, a third of it the
time-zone arithmetic of ``formatTime`` and a quarter the ``{text}`` formatting.
"""

from __future__ import annotations

from typing import IO, Any

from twisted.logger import FileLogObserver, eventAsText, formatTime

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


def text_line(event: dict[str, Any], index: int, when: CachedTime) -> str | None:
    """twisted.logger's ``formatEventAsClassicLogText`` of worker ``index``'s event, the same text."""
    if event.get("log_format") == "{text}" and "log_failure" not in event:
        text = str(event.get("text"))
    else:
        text = eventAsText(event, includeTimestamp=False, includeSystem=False)
        if not text:
            return None
    line = f"{when(event.get('log_time'))} [{worker_system(index, event)}] {text}"
    return line.replace("\n", "\n\t") + "\n"


def text_observer(out: IO[str], index: int) -> FileLogObserver:
    """Worker ``index``'s events as twistd's text lines on ``out``."""
    when = CachedTime()
    return FileLogObserver(out, lambda event: text_line(event, index, when))
