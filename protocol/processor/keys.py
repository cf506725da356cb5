"""Who the processor's tasks and engines are: engine keys, localities, routes and origins; pure values."""

from __future__ import annotations

from collections.abc import Hashable
from enum import Enum
from typing import NamedTuple

__all__ = ["EngineKey", "Locality", "Origin", "Route"]


#: What the caller uses to reach an engine: for a local engine its gRPC
#: stream (or any key for it), for a remote engine the accepted peer that reported it. The
#: processor only compares routes and hands them back in effects.
Route = Hashable

#: What the caller uses to reach whoever submitted a task: an HTTP request,
#: a dialled peer (a peer's forwarded tasks). Handed back in :class:`DeliverResult` and
#: :class:`FailRequest` so that one dispatcher serves every origin.
Origin = Hashable


class Locality(Enum):
    """Whether an engine is attached to this gateway or reported by a peer gateway."""

    LOCAL = "local"
    REMOTE = "remote"


class EngineKey(NamedTuple):
    """Engines are identified per tenant: two tenants may reuse an engine id.

    A tuple, not a frozen dataclass: routing and the processor hash and compare keys
    about twenty times per request, which a tuple does without a Python call."""

    tenant_id: str
    engine_id: str
