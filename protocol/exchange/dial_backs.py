"""Peers that dial this gateway unasked: when to dial them back, and when to warn instead.

Rules this file keeps: no I/O, no clock reads (``now`` is every input's last argument).

Reports flow one way on a ``ProcessTasksInternal`` stream: the dialler tells the dialled
gateway its engines. A gateway A that lists B in ``--peers`` while B does not list A gives
half a cluster: B learns A's engines, A never learns B's, and A answers 404 for B's
models. So a peer that dials in, and that this gateway does not dial, is dialled back:

- an infx dialler says in its request headers at which port its internal server listens
  (:data:`PEER_PORT_HEADER`); it is dialled back at that port of the address its connection
  came from;
- every accepting infx gateway names its pod in its response headers (:data:`POD_HEADER`),
  so that a dialler knows which pod each of its dials reached, whatever name its
  ``--peers`` gave it, and never dials one pod twice;
- the dial-back waits ``delay`` seconds after the peer's first report, so that this
  gateway's own dials (or its pod watcher) can show they reach that pod already; a peer
  that gave no port (LLMariner's gateway) is warned about then instead.

The gateway core (:mod:`protocol.gateway.core`) asks whether it dials a pod already and
opens the dial-back; this file only keeps the schedule.
"""

from __future__ import annotations

from protocol.grpc.metadata import Metadata
from protocol.discovery.peers import PeerAddress

__all__ = ["POD_HEADER", "PEER_PORT_HEADER", "DialBacks", "dial_back_address", "pod_of"]

#: Response-header key by which an accepting infx gateway names its pod.
POD_HEADER = "x-infx-pod"
#: Request-header key by which a dialling infx gateway gives the port its internal server listens on.
PEER_PORT_HEADER = "x-infx-peer-port"


def _value(metadata: Metadata, name: str) -> str:
    for key, value in metadata:
        if key == name:
            return (value.decode("latin-1") if isinstance(value, bytes) else value).strip()
    return ""


def pod_of(metadata: Metadata) -> str:
    """The pod an accepting gateway names in its response headers ("" for a LLMariner gateway)."""
    return _value(metadata, POD_HEADER)


def dial_back_address(metadata: Metadata, host: str) -> PeerAddress | None:
    """Where a dialler connecting from ``host`` may be dialled back, from its request headers;
    None when it gave no valid port."""
    port = _value(metadata, PEER_PORT_HEADER)
    if not port.isdigit() or not 0 < int(port) <= 65535 or not host:
        return None
    return PeerAddress(host, int(port))


class DialBacks:
    """Peers that dialled in unasked, and when each is due to be dialled back (or warned about).

    ``delay`` None turns dial-backs off (a unit test's core, the simulation's full mesh).
    """

    def __init__(self, delay: float | None) -> None:
        self.delay = delay
        self._due: dict[str, tuple[float, object | None]] = {}

    def dialled_in(self, pod: str, address: object | None, now: float) -> None:
        """``pod``, which this gateway does not dial, reported on a stream it opened here."""
        if self.delay is not None and pod not in self._due:
            self._due[pod] = (now + self.delay, address)

    def settled(self, pod: str) -> None:
        """Nothing to dial back for ``pod`` any more: a dial reaches it."""
        self._due.pop(pod, None)

    def due(self, now: float) -> list[tuple[str, object | None]]:
        """The pods whose time came, with where to dial them back (None: nowhere, warn)."""
        ready = sorted(pod for pod, (at, _) in self._due.items() if at <= now)
        return [(pod, self._due.pop(pod)[1]) for pod in ready]

    def next_deadline(self) -> float | None:
        return min((at for at, _ in self._due.values()), default=None)
