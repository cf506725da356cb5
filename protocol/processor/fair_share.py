"""Engine slots each caller holds, who may take an engine's last free slots, and the caller a
forwarded task carries; pure.

Rules this file keeps: no I/O, no clock, no randomness.

A *flow* is one caller sharing a tenant's engines for one model (see
:mod:`protocol.processor.fair_queue`). With an in-flight cap per engine, fairness is
by slots held: the held queue serves the flow that holds the fewest slots
per weight first, and the last ``reserve`` free slots of an engine go only
to such a flow (or to a critical task). A flow that fills every engine in a
burst therefore leaves a few slots on each, and another caller's next
request starts at once on the engine that holds its cache, rather than
waiting for a slot to free behind the burst, or spilling to an engine that
holds nothing of its conversation. A flow alone on a model is the least
served, so a lone caller may use every slot: the reserve costs nothing
until a second caller comes.

Across gateways, an engine's slots are granted by the engine's own gateway,
which sees every task sent to it. A task forwarded to a peer's engine
carries its caller (``TaskRequest.infx_caller``), so that the peer counts
it for the right flow and, should the engine be full, holds it in the
engine's queue in its turn among every gateway's callers.

Memory: one record per (tenant, model, flow) with a task held or waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import RemoteProtocolError
from protocol.pb import worker_pb2
from protocol.processor.fair_queue import Criticality, weight_problem

__all__ = ["CallerRefused", "FairShares", "caller_message", "forwarded_caller"]

#: Longest flow name a peer may send (an API key's id or the name keys share).
MAX_FLOW_NAME = 256

_WIRE = {
    Criticality.STANDARD: worker_pb2.Caller.CRITICALITY_STANDARD,
    Criticality.CRITICAL: worker_pb2.Caller.CRITICALITY_CRITICAL,
    Criticality.SHEDDABLE: worker_pb2.Caller.CRITICALITY_SHEDDABLE,
}
_FROM_WIRE = {wire: criticality for criticality, wire in _WIRE.items()}


class CallerRefused(ValueError, RemoteProtocolError):
    """A peer forwarded a task whose caller is malformed (weight, criticality or name)."""


def caller_message(flow: str, weight: float, criticality: Criticality) -> worker_pb2.Caller | None:
    """The caller a task forwarded to a peer's engine carries; None for the default caller
    (no flow, weight 1, standard), which an absent field means."""
    if not flow and weight == 1.0 and criticality is Criticality.STANDARD:
        return None
    return worker_pb2.Caller(flow=flow, weight=weight, criticality=_WIRE[criticality])


def forwarded_caller(request: worker_pb2.TaskRequest) -> tuple[str, float, Criticality]:
    """(flow, weight, criticality) of a task a peer forwarded; raises :class:`CallerRefused`."""
    if not request.HasField("infx_caller"):
        return "", 1.0, Criticality.STANDARD
    caller = request.infx_caller
    weight = caller.weight or 1.0
    problem = weight_problem(weight)
    if problem:
        raise CallerRefused(f"forwarded caller: {problem}")
    criticality = _FROM_WIRE.get(caller.criticality)
    if criticality is None:
        raise CallerRefused(f"forwarded caller has an unknown criticality ({caller.criticality})")
    if len(caller.flow) > MAX_FLOW_NAME:
        raise CallerRefused(f"forwarded caller's flow name is longer than {MAX_FLOW_NAME} characters")
    return caller.flow, weight, criticality


@dataclass(slots=True)
class _Share:
    weight: float
    held: int = 0
    waiting: int = 0

    @property
    def served(self) -> float:
        """Slots held per weight: what fairness compares."""
        return self.held / self.weight


class FairShares:
    """Slots held and tasks waiting per (tenant, model, flow)."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], dict[str, _Share]] = {}

    def dispatched(self, tenant_id: str, model: str, flow: str, weight: float) -> None:
        """A task of ``flow`` took a slot on an engine."""
        self._share(tenant_id, model, flow, weight).held += 1

    def left(self, tenant_id: str, model: str, flow: str) -> None:
        """A task of ``flow`` gave its slot back (ended, failed over, sent back busy)."""
        share = self._models[(tenant_id, model)][flow]
        share.held -= 1
        self._forget_if_idle(tenant_id, model, flow, share)

    def started_waiting(self, tenant_id: str, model: str, flow: str, weight: float) -> None:
        """A task of ``flow`` waits for a slot: the flow is active even while it holds none."""
        self._share(tenant_id, model, flow, weight).waiting += 1

    def stopped_waiting(self, tenant_id: str, model: str, flow: str) -> None:
        share = self._models[(tenant_id, model)][flow]
        share.waiting -= 1
        self._forget_if_idle(tenant_id, model, flow, share)

    def held(self, tenant_id: str, model: str) -> dict[str, int]:
        """Slots each flow holding one holds on the model's engines."""
        return {flow: share.held for flow, share in self._models.get((tenant_id, model), {}).items() if share.held}

    def served(self, tenant_id: str, model: str, flow: str) -> float:
        """Slots ``flow`` holds per weight (0 if it holds none)."""
        share = self._models.get((tenant_id, model), {}).get(flow)
        return 0.0 if share is None else share.served

    def least_served(self, tenant_id: str, model: str, flow: str, weight: float) -> bool:
        """Whether ``flow`` (its next task weighing ``weight``) holds no more slots per weight
        than any other flow holding or waiting for the model's engines: it may take an
        engine's reserved slots."""
        shares = self._models.get((tenant_id, model))
        if not shares:
            return True
        mine = shares.get(flow)
        own = 0.0 if mine is None else mine.held / weight
        return all(own <= share.served for name, share in shares.items() if name != flow)

    def least_served_waiting(self, tenant_id: str, model: str) -> frozenset[str]:
        """The flows with a task waiting that hold the fewest slots per weight: those whose
        waiting tasks may take an engine's reserved slots (:meth:`least_served`); O(flows)."""
        shares = self._models.get((tenant_id, model))
        if not shares:
            return frozenset()
        fewest = min(share.served for share in shares.values())
        return frozenset(name for name, share in shares.items() if share.waiting and share.served <= fewest)

    def _share(self, tenant_id: str, model: str, flow: str, weight: float) -> _Share:
        shares = self._models.setdefault((tenant_id, model), {})
        share = shares.get(flow)
        if share is None:
            share = shares[flow] = _Share(weight)
        share.weight = weight
        return share

    def _forget_if_idle(self, tenant_id: str, model: str, flow: str, share: _Share) -> None:
        if share.held or share.waiting:
            return
        shares = self._models[(tenant_id, model)]
        del shares[flow]
        if not shares:
            del self._models[(tenant_id, model)]
