"""twistd's text log, the same lines for less CPU: the observer a one-process gateway gives twistd.

twistd writes each event through twisted.logger's ``textFileLogObserver``,
which computes the time stamp (time-zone arithmetic) and formats the event's
text (``string.Formatter``) for every line. The request log writes a line per
request, so that was a tenth of a gateway's CPU by URL at concurrency 32
(``py-spy`` of ``twistd infx --runtime-url``, ``Logger.info`` 9 % of its
Python samples, half of it formatting). :class:`TextLog`, the top service of
``twistd infx`` in one process, gives twistd's application, as its
``ILogObserver``, the observer twistd would have made from its own options
(standard output, or ``--logfile`` with its rotation and ``SIGUSR1``) with a
formatter that makes the same line for less (:func:`classic_line`): the time
stamp once per second (:class:`~infx.supervisor.logs.CachedTime`), and an
event whose format is ``{text}`` (the request log's, rendered where it is
made) not formatted again. Where twistd logs elsewhere (``--syslog``,
``--logger``, a daemon told to log to standard output) it is left to twistd.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import FileLogObserver, ILogObserver, formatEventAsClassicLogText
from twisted.python.components import Componentized
from twisted.python.logfile import LogFile

from infx.supervisor.logs import CachedTime

__all__ = ["TextLog", "classic_line", "text_log_observer"]


def classic_line(event: dict[str, Any], when: CachedTime) -> str | None:
    """twisted.logger's ``formatEventAsClassicLogText(event)``: the same text, or None for none."""
    text = event.get("text")
    if (event.get("log_format") != "{text}" or type(text) is not str or "log_failure" in event
            or "log_flattened" in event):
        return formatEventAsClassicLogText(event, formatTime=when)
    if not text:
        return None
    system = event.get("log_system")
    if system is None:
        level = event.get("log_level")
        system = f"{event.get('log_namespace', '-')}#{'-' if level is None else level.name}"
    else:
        try:
            system = str(system)
        except Exception:
            system = "UNFORMATTABLE"
    return f"{when(event.get('log_time'))} [{system}] {text}".replace("\n", "\n\t") + "\n"


def text_log_observer(twistd: Any) -> FileLogObserver | None:
    """The observer twistd's ``UnixAppLogger`` would make from its options ``twistd``, with
    :func:`classic_line`; None where twistd logs other than to a file or standard output."""
    if twistd is None or twistd.get("syslog") or twistd.get("logger"):
        return None
    name, foreground = twistd.get("logfile"), twistd.get("nodaemon", False)
    out: Any
    if name == "-" or (foreground and not name):
        if not foreground:
            return None  # twistd refuses this itself: "Daemons cannot log to stdout"
        out = sys.stdout
    else:
        out = LogFile.fromFullPath(name or "twistd.log")
        if not signal.getsignal(signal.SIGUSR1):
            def rotate(signum: int, frame: Any) -> None:
                from twisted.internet import reactor

                reactor.callFromThread(out.rotate)

            signal.signal(signal.SIGUSR1, rotate)
    when = CachedTime()
    return FileLogObserver(out, lambda event: classic_line(event, when))


class TextLog(MultiService):
    """``service``, which gives the application it joins :func:`text_log_observer`'s observer
    (twistd asks the application for one before making its own)."""

    def __init__(self, service: Any, twistd: Any) -> None:
        super().__init__()
        self.twistd = twistd
        service.setServiceParent(self)

    def setServiceParent(self, parent: Any) -> None:
        super().setServiceParent(parent)
        if isinstance(parent, Componentized) and parent.getComponent(ILogObserver, None) is None:
            observer = text_log_observer(self.twistd)
            if observer is not None:
                parent.setComponent(ILogObserver, observer)
