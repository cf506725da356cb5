"""What the gateway core (:mod:`protocol.gateway.core`) asks its adapters to do, and its configuration.

No I/O: every class here is a frozen value. The core returns these, together
with the processor's own I/O effects that it passes through unchanged
(``SendTask``, ``CancelTaskOnEngine``, ``CloseEngine``, ``CloseRoute`` on
engine and peer routes; ``DeliverResult``, ``FailRequest`` for HTTP requests;
``TaskQueued`` for the scaler), in the order the adapter must perform them.
Handles (engine streams, accepted peer streams, HTTP requests) are the
adapter's own objects, compared by identity; a :class:`Dial` is the core's
handle for one stream it asks the adapter to open to a peer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from protocol.backoff import Backoff
from protocol.grpc import StatusCode
from protocol.pb import internal_pb2
from protocol.processor.effects import Effect
from protocol.processor.errors import ProcessorUsageError

__all__ = [
    "DIAL_BACK_SECONDS",
    "PEER_LEARNING_SECONDS",
    "CancelDial",
    "CoreConfig",
    "CoreEffect",
    "Dial",
    "EndPeerStream",
    "HalfCloseDial",
    "ModelServed",
    "OpenDial",
    "PeerDisconnected",
    "PeerDialledBack",
    "PeerDialledIn",
    "PeerDraining",
    "PeerOneWay",
    "PeerGone",
    "PeerRequests",
    "ReportLoad",
    "RequestDispatched",
    "RequestFinished",
    "RequestStarted",
    "SendOnDial",
    "TaskReleased",
]


#: At start-up, how long a request for a model no engine lists yet waits for the peers' first
#: reports rather than getting 404 (a live peer reports within a round trip of our dial, as it
#: dials back at once; this bounds the wait on a peer that is down). ``twistd infx`` uses it.
PEER_LEARNING_SECONDS = 5.0

#: How long after a peer that this gateway does not dial first reported it is dialled back
#: (:mod:`protocol.exchange.dial_backs`): time for our own dials to show they reach it under another
#: name. ``twistd infx`` uses it.
DIAL_BACK_SECONDS = 2.0


@dataclass(frozen=True)
class CoreConfig:
    """How the core joins the processor to peers and the scaler.

    ``pod_name`` names this gateway in its reports to peers;
    ``status_interval``: seconds between checks that re-report local engines
    (and request counts) to peers if anything changed; ``redial_backoff``
    spaces redials of a peer whose stream ended; ``forget_models_after``: a
    model no engine has listed for this long is unknown (404) again rather
    than gone (503); ``load_interval``: seconds between in-flight load reports
    to an attached scaler; ``learn_peers_within``: seconds after start-up (the
    first peers known) during which a request for a model no engine lists yet
    waits for the peers' first reports instead of getting 404 at once (it ends
    sooner, when every dialled peer has reported; 0, the default, turns it off);
    ``redial_when_dialled_in``: a peer we back off from that dials us is up
    again (a restart), so it is redialled at once. Both are on in ``twistd
    infx`` and in the simulation, and off by default, so that a core built
    bare in a unit test answers at once. ``dial_back_after``: seconds after a
    peer that this gateway does not dial first reported on its stream, at
    which it is dialled back, or warned about if it gave no port to dial
    (:mod:`protocol.exchange.dial_backs`); None, the default, never (``twistd infx``
    sets it; the simulation's peers all dial each other).
    """

    pod_name: str
    status_interval: float = 10.0
    redial_backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.2, factor=2.0, cap=10.0, jitter=0.5))
    forget_models_after: float = 3600.0
    load_interval: float = 1.0
    learn_peers_within: float = 0.0
    redial_when_dialled_in: bool = False
    dial_back_after: float | None = None

    def __post_init__(self) -> None:
        if self.status_interval <= 0 or self.load_interval <= 0 or self.forget_models_after < 0 \
                or self.learn_peers_within < 0:
            raise ProcessorUsageError("status_interval and load_interval must be > 0, "
                                      "forget_models_after and learn_peers_within >= 0")


class Dial:
    """One stream this gateway opens to a peer: the core's handle, compared by identity.

    A redial is a new ``Dial``; inputs naming a dial that is no longer the
    peer's current one are ignored (a late event of a stream already given up).
    """

    __slots__ = ("name", "address", "attempt")

    def __init__(self, name: str, address: object, attempt: int) -> None:
        self.name = name
        self.address = address
        self.attempt = attempt

    def __repr__(self) -> str:
        return f"<Dial {self.name} {self.address} #{self.attempt}>"


# --- peers we dial ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenDial:
    """Open ``dial``'s ``ProcessTasksInternal`` stream to ``dial.address`` (the core's reports follow)."""

    dial: Dial


@dataclass(frozen=True, slots=True)
class SendOnDial:
    """Write ``message`` on ``dial``'s stream, after those asked for before it."""

    dial: Dial
    message: internal_pb2.ProcessTasksInternalRequest


@dataclass(frozen=True, slots=True)
class HalfCloseDial:
    """``dial`` drained (every forwarded task ended): end our side of its stream."""

    dial: Dial


@dataclass(frozen=True, slots=True)
class CancelDial:
    """Give ``dial``'s stream up now (the peer left, moved, broke the protocol, or we stop)."""

    dial: Dial
    reason: str


# --- peers that dialled us ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndPeerStream:
    """End an accepted peer stream with ``code`` (the core has already forgotten it)."""

    stream: object
    code: StatusCode
    message: str


@dataclass(frozen=True, slots=True)
class PeerDialledIn:
    """A peer's first report on ``stream`` (for the log)."""

    stream: object
    pod_name: str
    engines: int


@dataclass(frozen=True, slots=True)
class PeerDialledBack:
    """``pod_name`` dialled in, and this gateway did not dial it: it is dialled back at ``address`` (for the log)."""

    pod_name: str
    address: object


@dataclass(frozen=True, slots=True)
class PeerOneWay:
    """``pod_name`` dialled in, this gateway does not dial it and it gave no port to dial it back at
    (a LLMariner gateway): its engines serve here, ours not there (a warning for the log)."""

    pod_name: str


@dataclass(frozen=True, slots=True)
class PeerDraining:
    """The peer on ``stream`` reported it is draining (for the log)."""

    stream: object
    pod_name: str


@dataclass(frozen=True, slots=True)
class PeerDisconnected:
    """The peer's ``stream`` is gone here, with the engines it had registered (for the log)."""

    stream: object
    pod_name: str
    engines: int


@dataclass(frozen=True, slots=True)
class PeerRequests:
    """The peer on ``stream`` reported the requests per model it accepted since it started (scaler)."""

    stream: object
    counts: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class PeerGone:
    """``stream``'s reports ended (the scaler starts a new baseline for it)."""

    stream: object


# --- HTTP requests and the scaler ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """A client's request for ``model`` was accepted (scaler load)."""

    model: str


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """The request counted by :class:`RequestStarted` ended (answered, failed or cancelled)."""

    model: str


@dataclass(frozen=True, slots=True)
class RequestDispatched:
    """The HTTP request ``origin`` was sent to an engine for the first time as attempt ``wire_id``
    (its wait in the queue ends, unless the route refused that send)."""

    origin: object
    wire_id: str


@dataclass(frozen=True, slots=True)
class ModelServed:
    """A task the scaler held for ``model`` left the queue for an engine: the model is ready."""

    model: str


@dataclass(frozen=True, slots=True)
class TaskReleased:
    """A task the scaler held ended without an engine (failed or cancelled): forget it."""

    task_id: str


@dataclass(frozen=True, slots=True)
class ReportLoad:
    """``count`` tasks of ``model`` are in flight on engines (scaler load; 0 once none are)."""

    model: str
    count: int


CoreEffect = Union[
    Effect,
    OpenDial,
    SendOnDial,
    HalfCloseDial,
    CancelDial,
    EndPeerStream,
    PeerDialledIn,
    PeerDialledBack,
    PeerOneWay,
    PeerDraining,
    PeerDisconnected,
    PeerRequests,
    PeerGone,
    RequestStarted,
    RequestFinished,
    RequestDispatched,
    ModelServed,
    TaskReleased,
    ReportLoad,
]
