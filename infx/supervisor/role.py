"""What a supervisor tells one worker process: its config, which worker it is, and its sockets.

Every worker gets the supervisor's own :class:`~infx.config.GatewayConfig`, whole: the
same runtimes, keys, peers and limits, so each worker decides alone and decides alike
(every worker routes a conversation to the same engine). What differs is the
:class:`WorkerRole`: its index and pod name, its internal port, its siblings and the
listening sockets it adopts. Both travel as one JSON line on the worker's standard
input (never on its command line or in its environment, where ``ps`` and
``/proc`` would show the internal secret), and the supervisor keeps that pipe open:
its end tells the worker the supervisor is gone.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from infx.config import GatewayConfig

#: The worker's descriptor on which it tells its supervisor ``listening`` (a line); its listening
#: sockets follow it.
STATUS_FD = 3
LISTENING = b"listening\n"

__all__ = ["LISTENING", "STATUS_FD", "WorkerRole", "config_from_json", "config_to_json", "worker_pod_name"]


@dataclass(frozen=True)
class WorkerRole:
    """One worker's place among its supervisor's workers.

    ``fds`` names the listening sockets it inherited: ``http``, ``worker_grpc`` and
    ``internal_grpc`` (the listen options' own), ``engines_private`` (a loopback port of
    its own engine-facing service, which its built-in engine dials, since the shared one
    may land on a sibling) and ``metrics_private`` (a loopback port serving its own
    ``/metrics``, which the worker that answers a scrape reads from each sibling).
    ``families`` gives each socket's address family. ``internal_ports`` lists every
    worker's internal port (it goes in the accept headers, see
    :mod:`protocol.supervisor.siblings`), ``siblings`` maps each other worker's pod name
    to its internal ``[host, port]``, and ``metrics_ports`` lists every worker's private
    metrics port by index. The worker tells its supervisor it listens by a line on
    :data:`STATUS_FD`.
    """

    index: int
    count: int
    pod_name: str
    fds: dict[str, int]
    families: dict[str, int]
    internal_ports: tuple[int, ...]
    siblings: dict[str, tuple[str, int]] = field(default_factory=dict)
    metrics_ports: tuple[int, ...] = ()
    #: Write log lines as text to the inherited standard output (else JSON events to the
    #: supervisor's pipe); see :mod:`infx.supervisor.logs`.
    log_text: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerRole:
        return cls(index=int(data["index"]), count=int(data["count"]), pod_name=str(data["pod_name"]),
                   fds={str(k): int(v) for k, v in data["fds"].items()},
                   families={str(k): int(v) for k, v in data["families"].items()},
                   internal_ports=tuple(int(p) for p in data["internal_ports"]),
                   siblings={str(k): (str(v[0]), int(v[1])) for k, v in data["siblings"].items()},
                   metrics_ports=tuple(int(p) for p in data["metrics_ports"]), log_text=bool(data["log_text"]))


def worker_pod_name(pod_name: str, index: int) -> str:
    """Worker ``index``'s name among gateways: worker 0 keeps the pod's (``POD_NAME``, which the
    pod watchers of other gateways know it by), the others add ``-wN``."""
    return pod_name if index == 0 else f"{pod_name}-w{index}"


def config_to_json(config: GatewayConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_json(data: dict[str, Any]) -> GatewayConfig:
    """The config a supervisor validated, as it was (tuples stay tuples)."""
    values = {}
    for item in dataclasses.fields(GatewayConfig):
        value = data[item.name]
        values[item.name] = tuple(value) if isinstance(value, list) else value
    return GatewayConfig(**values)


def encode(config: GatewayConfig, role: WorkerRole) -> bytes:
    """The line a worker reads on its standard input."""
    return json.dumps({"config": config_to_json(config), "role": role.to_json()}).encode() + b"\n"


def decode(line: bytes) -> tuple[GatewayConfig, WorkerRole]:
    data = json.loads(line)
    return config_from_json(data["config"]), WorkerRole.from_json(data["role"])
