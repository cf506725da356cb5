"""Listening sockets made by the supervisor and adopted by its workers.

The supervisor binds every port before any worker runs (in
``privilegedStartService``, so before ``twistd -u/-g`` drops root, and so a port
that cannot be bound stops the start with one line, as with one process) and
keeps the sockets for its whole life: a worker started again adopts the same
socket, and connections that arrive while it restarts wait in that socket's
backlog instead of being refused.

The HTTP and engine-facing ports are shared: one socket per worker, all bound to
the same address with ``SO_REUSEPORT``, so the kernel spreads new connections
over the workers. Before that group is made, the address is bound once without
``SO_REUSEPORT``, so a port another process holds fails as it does without
workers (and another process of this user cannot join the group by accident
while this one is up: only sockets that set ``SO_REUSEPORT`` may). The internal
port is one per worker (the given port, then the next ones), since every other
gateway must reach each worker (see :mod:`protocol.supervisor.siblings`).

Only ``tcp:``, ``tcp6:`` and ``ssl:`` endpoints can be shared; a worker wraps an
adopted ``ssl:`` socket in TLS with the endpoint's own certificate and key.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP6ServerEndpoint, serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint
from zope.interface import implementer

from infx.config import ConfigError
from infx.service import ListenFailed

__all__ = ["AdoptedEndpoint", "ListenAddress", "bind_group", "bind_one", "listen_address"]


@dataclass(frozen=True)
class ListenAddress:
    """Where a listen option's endpoint binds: address family, interface, port, backlog, TLS or not."""

    family: int
    interface: str
    port: int
    backlog: int
    tls: bool
    #: The endpoint string, as errors name it.
    description: str = ""


def listen_address(description: str, option: str) -> ListenAddress:
    """The address of a ``tcp:``, ``tcp6:`` or ``ssl:`` endpoint string; any other kind cannot
    be shared by workers (a :class:`~infx.config.ConfigError` that says so)."""
    endpoint = serverFromString(None, description)
    # Twisted's server endpoints keep what they bind in these attributes (unchanged since 10.1).
    if not hasattr(endpoint, "_port") or not hasattr(endpoint, "_interface"):
        raise ConfigError(f"{option}: {description!r} cannot be shared by --workers; give a tcp:, tcp6: or ssl: "
                          "endpoint, or --workers 1")
    family = socket.AF_INET6 if isinstance(endpoint, TCP6ServerEndpoint) or ":" in endpoint._interface \
        else socket.AF_INET
    interface = endpoint._interface or ("::" if family == socket.AF_INET6 else "0.0.0.0")
    return ListenAddress(family, interface, int(endpoint._port), int(endpoint._backlog),
                         isinstance(endpoint, SSL4ServerEndpoint), description)


def bind_one(address: ListenAddress, option: str, port: int | None = None, reuse_port: bool = False) -> socket.socket:
    """A listening socket at ``address`` (at ``port`` instead of its own, if given)."""
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if address.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if address.interface == "::" else 1)
        sock.bind((address.interface, address.port if port is None else port))
        sock.listen(address.backlog)
    except OSError as e:
        sock.close()
        number = address.port if port is None else port
        where = address.description if number == address.port and address.description else \
            f"{address.interface}:{number}"
        raise ListenFailed(f"{option}: cannot listen on {where}: {_why(e, number)}") from None
    sock.setblocking(False)
    return sock


def bind_group(address: ListenAddress, option: str, count: int) -> list[socket.socket]:
    """``count`` sockets sharing ``address`` with ``SO_REUSEPORT`` (port 0: one the kernel picks).

    A given port is probed first (see the module docstring). Port 0 is not: the kernel's pick is
    free, and the group's first socket holds it from the moment it is picked, since a probe let go
    before the group bound would leave the port for any other process to take meanwhile."""
    sockets: list[socket.socket] = []
    if address.port == 0:
        sockets.append(bind_one(address, option, reuse_port=True))
        port = sockets[0].getsockname()[1]
    else:
        probe = bind_one(address, option)
        port = probe.getsockname()[1]
        probe.close()
    try:
        while len(sockets) < count:
            sockets.append(bind_one(address, option, port, reuse_port=True))
    except ListenFailed:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _why(error: OSError, port: int) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is already in use"
    if error.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied for port {port} (ports below 1024 need root: start twistd as root with -u/-g "
                "to drop privileges after binding)")
    return error.strerror or str(error)


@implementer(IStreamServerEndpoint)
class AdoptedEndpoint:
    """A worker's endpoint on a listening socket its supervisor made (file descriptor ``fd``), or
    one process's on its internal port 0, bound as the gateway was built (its port names it).

    ``description`` is the listen option's endpoint string: for ``ssl:`` it gives the certificate
    and key the connections are wrapped with."""

    def __init__(self, reactor: Any, fd: int, family: int, description: str) -> None:
        self.reactor = reactor
        self.fd = fd
        self.family = family
        self.description = description

    def listen(self, factory: Any) -> defer.Deferred[Any]:
        return defer.maybeDeferred(self._adopt, factory)

    def _adopt(self, factory: Any) -> Any:
        if self.description.startswith("ssl:"):
            from twisted.protocols.tls import TLSMemoryBIOFactory

            endpoint = serverFromString(self.reactor, self.description)
            factory = TLSMemoryBIOFactory(endpoint._sslContextFactory, False, factory)
        # adoptStreamPort duplicates the descriptor: the inherited one is closed once adopted.
        port = self.reactor.adoptStreamPort(self.fd, self.family, factory)
        socket.close(self.fd)
        return port
