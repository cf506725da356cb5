"""The supervisor: ``twistd infx --workers N`` binds the ports, runs N gateway processes and watches them.

It performs :class:`protocol.supervisor.pool.WorkerPool`'s effects: it spawns each worker
(``python -m infx.supervisor.worker``) with the sockets of :mod:`infx.supervisor.sockets`
and its config and role on its standard input, publishes its log events as its own
(each with ``worker``, its text prefixed ``[worker-N ...]``), starts a worker that exits
again after the pool's backoff, and on stop (SIGTERM, or the end of twistd) sends every
worker SIGTERM, waits for their drains (the grace period and a margin) and kills those
left. The supervisor itself serves nothing: twistd's pidfile, daemon mode and
``-u``/``-g`` apply to it, and its workers run as the user it runs as.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

from twisted.application import service
from twisted.internet import defer, error, protocol
from twisted.logger import Logger, eventFromJSON, globalLogPublisher
from twisted.python.failure import Failure

from infx.cli import EXIT_CANNOT_LISTEN
from infx.config import ConfigError, GatewayConfig
from infx.deadline import DeadlineTimer
from infx.supervisor.logs import worker_system
from infx.supervisor.role import LISTENING, STATUS_FD, WorkerRole, encode
from infx.service import ListenFailed
from infx.supervisor.sockets import ListenAddress, bind_group, bind_one, listen_address
from protocol.supervisor.pool import (
    KillWorker, PoolConfig, PoolEffect, PoolListening, PoolStopped, SpawnWorker, StopWorker, WorkerPool,
    WorkerRestartDue,
)

__all__ = ["Supervisor"]

log = Logger(namespace="infx.supervisor")

#: Seconds a worker gets past the grace period to finish its drain before SIGKILL.
KILL_MARGIN = 10.0


class Supervisor(service.Service):
    """N gateway workers sharing ``config``'s ports; see the module docstring.

    ``pod_name(internal_port, index)`` names worker ``index`` among gateways
    (see :func:`infx.service.default_pod_name`); ``publish`` takes the workers' log events
    (default: twisted.logger's global publisher, which twistd's observers read).
    """

    def __init__(self, reactor: Any, config: GatewayConfig, workers: int,
                 pod_name: Callable[[int, int], str], environ: Mapping[str, str] | None = None,
                 publish: Callable[[dict[str, Any]], None] | None = None, rng: random.Random | None = None,
                 daemon: bool = False, log_text: bool = False) -> None:
        self.reactor = reactor
        self.config = config
        self.count = workers
        self.pod_name = pod_name
        self.environ = dict(os.environ if environ is None else environ)
        self.publish = publish or globalLogPublisher
        self.rng = rng or random.SystemRandom()
        self.daemon = daemon
        #: Workers write text lines to the supervisor's standard output themselves (twistd -n logging
        #: there); else they send events to be published here (:mod:`infx.supervisor.logs`).
        self.log_text = log_text
        self.pool = WorkerPool(PoolConfig(workers=workers, kill_after=config.grace_period + KILL_MARGIN))
        self._timer = DeadlineTimer(reactor, self._fire)
        self._sockets: dict[str, list[socket.socket]] = {}
        self._internal_ports: tuple[int, ...] = ()
        self._metrics_ports: tuple[int, ...] = ()
        self._processes: dict[int, WorkerProcess] = {}
        self._stopped: defer.Deferred[None] = defer.Deferred()
        self.exit_code = 0
        #: Why the supervisor could not bind its ports (twistd's start-up checks it).
        self.listen_failure: ListenFailed | None = None

    # --- start: every socket first ---------------------------------------------------

    def privilegedStartService(self) -> None:
        service.Service.privilegedStartService(self)
        try:
            self._bind()
        except ListenFailed as e:
            for sockets in self._sockets.values():
                for sock in sockets:
                    sock.close()
            self._sockets = {}
            self.listen_failure = e
            log.critical("{error}", error=str(e))
            # As one gateway process does (infx.cli.ExitIfCannotListen): exit 1, or, daemonized,
            # hand the error to twistd's waiting parent.
            if self.daemon:
                raise
            raise SystemExit(EXIT_CANNOT_LISTEN) from None

    def _bind(self) -> None:
        config, n = self.config, self.count
        addresses: dict[str, ListenAddress] = {}
        for name, option in (("http", "--http"), ("worker_grpc", "--worker-grpc"), ("internal_grpc", "--internal-grpc")):
            try:
                addresses[name] = listen_address(getattr(config, name), option)
            except ConfigError as e:
                raise ListenFailed(str(e)) from None
        self._sockets["http"] = bind_group(addresses["http"], "--http", n)
        self._sockets["worker_grpc"] = bind_group(addresses["worker_grpc"], "--worker-grpc", n)
        internal = addresses["internal_grpc"]
        first = bind_one(internal, "--internal-grpc")
        base = first.getsockname()[1]
        # Worker i's internal port is the given one plus i (port 0: each one the kernel picks).
        self._sockets["internal_grpc"] = [first] + [
            bind_one(internal, "--internal-grpc", base + i if internal.port else 0) for i in range(1, n)]
        loopback = ListenAddress(socket.AF_INET, "127.0.0.1", 0, 50, False)
        self._sockets["engines_private"] = [bind_one(loopback, "a worker's own engine port") for _ in range(n)]
        self._sockets["metrics_private"] = [bind_one(loopback, "a worker's own metrics port") for _ in range(n)]
        self._internal_ports = tuple(s.getsockname()[1] for s in self._sockets["internal_grpc"])
        self._metrics_ports = tuple(s.getsockname()[1] for s in self._sockets["metrics_private"])
        http, engines = (self._sockets[name][0].getsockname() for name in ("http", "worker_grpc"))
        host = _host(internal.interface)
        log.info("{count} workers share the HTTP API's port {http} and the engines' port {engines}; their peer "
                 "ports are {host}:{ports}, one each", count=n, http=_where(http), engines=_where(engines), host=host,
                 ports=",".join(map(str, self._internal_ports)), event="supervisor_listening")

    def startService(self) -> None:
        service.Service.startService(self)
        if self.listen_failure is None:
            self._perform(self.pool.start(self.reactor.seconds()))

    def stopService(self) -> defer.Deferred[None]:
        service.Service.stopService(self)
        if self.listen_failure is not None or self._stopped.called:
            return defer.succeed(None)
        log.info("stopping {count} workers: each drains within the grace period", count=self.count)
        self._perform(self.pool.stop(self.reactor.seconds()))
        return self._stopped

    # --- the pool's effects -------------------------------------------------------------

    def _perform(self, effects: list[PoolEffect]) -> None:
        for effect in effects:
            if isinstance(effect, SpawnWorker):
                self._spawn(effect.index, effect.attempt)
            elif isinstance(effect, StopWorker):
                self._signal(effect.index, "TERM")
            elif isinstance(effect, KillWorker):
                log.warn("worker {index} did not finish its drain in time: killed", index=effect.index)
                self._signal(effect.index, "KILL")
            elif isinstance(effect, WorkerRestartDue):
                how = "was killed by a signal" if effect.code is None else f"exited with code {effect.code}"
                log.warn("worker {index} {how}: started again in {delay:.1f} s", index=effect.index, how=how,
                         delay=effect.delay, event="worker_exited", code=effect.code)
            elif isinstance(effect, PoolListening):
                log.info("all {count} workers listen", count=self.count, event="workers_listening")
            elif isinstance(effect, PoolStopped):
                self._stopped_with(effect)
        self._timer.arm(self.pool.next_deadline())

    def _fire(self) -> None:
        self._perform(self.pool.handle_timeout(self.reactor.seconds()))

    def _stopped_with(self, effect: PoolStopped) -> None:
        for sockets in self._sockets.values():
            for sock in sockets:
                sock.close()
        self._sockets = {}
        self.exit_code = effect.exit_code
        if effect.exit_code:
            log.critical("{reason}: the gateway stops (the worker's log above says why)", reason=effect.reason)
            if self.running:
                # A failed start: twistd stops, and the supervisor's exit code says so.
                from infx.cli import exit_after_shutdown

                self.reactor.addSystemEventTrigger("after", "shutdown", exit_after_shutdown, effect.exit_code)
                self.reactor.callLater(0, self.reactor.stop)
        if not self._stopped.called:
            self._stopped.callback(None)

    def _spawn(self, index: int, attempt: int) -> None:
        fds = {name: sockets[index].fileno() for name, sockets in self._sockets.items()}
        child_fds: dict[int, Any] = {0: "w", 1: 1 if self.log_text else "r", 2: 2 if self.log_text else "r",
                                     STATUS_FD: "r"}
        role_fds: dict[str, int] = {}
        for offset, (name, fd) in enumerate(sorted(fds.items())):
            child_fds[STATUS_FD + 1 + offset] = fd
            role_fds[name] = STATUS_FD + 1 + offset
        families = {name: sockets[index].family for name, sockets in self._sockets.items()}
        host = _host(listen_address(self.config.internal_grpc, "--internal-grpc").interface)
        pods = [self.pod_name(port, i) for i, port in enumerate(self._internal_ports)]
        role = WorkerRole(
            index=index, count=self.count, pod_name=pods[index], fds=role_fds,
            families={name: int(family) for name, family in families.items()},
            internal_ports=self._internal_ports,
            siblings={pods[i]: (host, port) for i, port in enumerate(self._internal_ports) if i != index},
            metrics_ports=self._metrics_ports, log_text=self.log_text)
        process = WorkerProcess(self, index)
        self._processes[index] = process
        argv = [sys.executable, "-m", "infx.supervisor.worker"]
        # Its sockets are inheritable while it is spawned, and no other worker's ever is.
        mine = [sockets[index] for sockets in self._sockets.values()]
        for sock in mine:
            sock.set_inheritable(True)
        try:
            self.reactor.spawnProcess(process, sys.executable, argv, env=self.environ, childFDs=child_fds)
        finally:
            for sock in mine:
                sock.set_inheritable(False)
        process.transport.write(encode(self.config, role))
        if attempt == 1:
            log.info("worker {index} started (pid {pid}) as {pod}", index=index, pid=process.transport.pid,
                     pod=pods[index], event="worker_started")
        else:
            log.info("worker {index} started again (pid {pid})", index=index, pid=process.transport.pid,
                     event="worker_started")
        self._perform(self.pool.spawned(index, self.reactor.seconds()))

    def _signal(self, index: int, name: str) -> None:
        process = self._processes.get(index)
        if process is None or process.transport is None:
            return
        try:
            process.transport.signalProcess(name)
        except error.ProcessExitedAlready:
            pass

    # --- what a worker says -------------------------------------------------------------------

    def worker_event(self, index: int, event: dict[str, Any]) -> None:
        """Publish one of worker ``index``'s log events as the supervisor's own."""
        event["worker"] = index
        event["log_system"] = worker_system(index, event)
        self.publish(event)

    def worker_listens(self, index: int) -> None:
        self._perform(self.pool.listening(index, self.reactor.seconds()))

    def worker_text(self, index: int, line: str) -> None:
        """A line worker ``index`` wrote outside its log (its standard error, a crash before logging)."""
        log.warn("{line}", line=line, worker=index, log_system=f"worker-{index} stderr")

    def worker_exited(self, index: int, reason: Failure) -> None:
        self._processes.pop(index, None)
        code = getattr(reason.value, "exitCode", None)
        if getattr(reason.value, "signal", None) is not None:
            code = None
        self._perform(self.pool.exited(index, code, self.reactor.seconds(), self.rng.random()))


class WorkerProcess(protocol.ProcessProtocol):
    """One worker's process: its JSON log lines on stdout, text on stderr, its end."""

    def __init__(self, supervisor: Supervisor, index: int) -> None:
        self.supervisor = supervisor
        self.index = index
        self._buffers = {1: b"", 2: b""}

    def childDataReceived(self, fd: int, data: bytes) -> None:
        if fd == STATUS_FD:
            if LISTENING in data:
                self.supervisor.worker_listens(self.index)
            return
        buffer = self._buffers.get(fd, b"") + data
        *lines, rest = buffer.split(b"\n")
        self._buffers[fd] = rest
        for line in lines:
            self._line(fd, line)

    def _line(self, fd: int, line: bytes) -> None:
        if not line.strip():
            return
        text = line.decode("utf-8", "replace")
        if fd == 1 and text.startswith("{"):
            try:
                event = eventFromJSON(text)
            except (ValueError, TypeError):
                event = None
            if isinstance(event, dict):
                self.supervisor.worker_event(self.index, event)
                return
        self.supervisor.worker_text(self.index, text)

    def processEnded(self, reason: Failure) -> None:
        for fd, rest in self._buffers.items():
            if rest:
                self._line(fd, rest)
        self._buffers = {1: b"", 2: b""}
        self.supervisor.worker_exited(self.index, reason)


def _host(interface: str) -> str:
    """Where siblings dial a worker's internal port: its interface, loopback for a wildcard."""
    if interface in ("", "0.0.0.0"):
        return "127.0.0.1"
    if interface == "::":
        return "::1"
    return interface


def _where(address: Any) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
