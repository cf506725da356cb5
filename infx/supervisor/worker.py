"""One worker process of ``twistd infx --workers N``: ``python -m infx.supervisor.worker``.

It reads its config and role (:mod:`infx.supervisor.role`) as one JSON line on its
standard input, builds the gateway on the sockets it inherited and runs it until
SIGTERM (it drains, as ``twistd infx`` does) or until its standard input ends (the
supervisor is gone: it drains too, rather than serve on unwatched). Once every port
listens it says so on :data:`~infx.supervisor.role.STATUS_FD`. Its log goes where
:mod:`infx.supervisor.logs` says.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

#: The worker's exit code when a port it was given cannot be adopted.
EXIT_CANNOT_LISTEN = 1


def watch_parent(reactor: Any, on_gone: Any) -> None:
    """Read the worker's standard input, which the supervisor keeps open: its end means the
    supervisor is gone, and ``on_gone`` is called."""
    from twisted.internet.abstract import FileDescriptor

    class StandardInput(FileDescriptor):
        def fileno(self) -> int:
            return 0

        def doRead(self) -> None:
            try:
                data = os.read(0, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                reactor.removeReader(self)
                on_gone()

        def connectionLost(self, reason: Any) -> None:
            # epoll reports a pipe whose writer is gone as a hang-up, which the reactor hands here
            # (not to doRead).
            on_gone()

    os.set_blocking(0, False)
    reactor.addReader(StandardInput(reactor))


def main() -> None:
    line = sys.stdin.buffer.readline()
    from infx.supervisor.role import decode

    config, role = decode(line)
    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, jsonFileLogObserver

    from infx.supervisor.logs import text_observer
    from infx.supervisor.role import LISTENING, STATUS_FD

    # Line by line: each line is one write, whole, whichever way it goes.
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    observer = text_observer(out, role.index) if role.log_text else jsonFileLogObserver(out, recordSeparator="")
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    from twisted.logger import Logger

    log = Logger(namespace="infx.supervisor.worker")
    from infx.service import build_gateway

    gateway = build_gateway(reactor, config, role=role)
    exit_code = [0]
    gone: list[bool] = []

    def cannot_listen(reason: Any) -> None:
        exit_code[0] = EXIT_CANNOT_LISTEN
        reactor.stop()

    def supervisor_gone() -> None:
        if gone:
            return
        gone.append(True)
        log.warn("the supervisor is gone: this worker drains and exits", event="supervisor_gone")
        reactor.callWhenRunning(reactor.stop)

    def listening(_: Any) -> None:
        os.write(STATUS_FD, LISTENING)

    gateway.when_listening().addCallbacks(listening, cannot_listen)
    reactor.callWhenRunning(gateway.startService)
    reactor.addSystemEventTrigger("before", "shutdown", gateway.stopService)
    watch_parent(reactor, supervisor_gone)
    # SIGINT from a terminal reaches the whole process group: the supervisor drains its workers
    # with SIGTERM, so a worker leaves SIGINT to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gateway.privilegedStartService()
    reactor.run()
    out.flush()
    os._exit(exit_code[0])


if __name__ == "__main__":
    main()
