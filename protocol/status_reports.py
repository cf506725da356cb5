"""Status reports between gateways: full snapshots for every peer, deltas for infx peers.

No I/O, no clock reads. Both ends of a ``ProcessTasksInternal`` stream keep
here what the stream has reported so far: the receiver (which reports its
local engines) in a :class:`ReportWriter`, the sender (which registers them)
in a :class:`ReportReader`.

LLMariner's receiver re-sends every engine on every change, to every peer:
with ``g`` gateways of ``e`` engines each, one change costs ``g`` reports of
``e`` engines. An infx sender says in the stream's response headers that it
reads deltas (:data:`STATUS_DELTA_HEADER`); only then does the writer send,
after the full snapshot every stream starts with, reports that carry the
engines that changed and the ids of those removed (ServerStatus fields
102-104). A LLMariner sender never says so and gets full snapshots, as today.

Every report is numbered on its stream (field 104). The stream is ordered
and reliable, so a gap means a report was lost by a bug somewhere: the reader
refuses the stream (:class:`RemoteProtocolError`) and the receiver's redial
starts again with a full snapshot; a number already read is a repeat and is
skipped. No periodic full snapshot is sent: it would cost every engine on
every peer per period for nothing a numbered ordered stream can lose, and
every new stream starts with one.

Load counts (in-progress tasks, the runtime's running/waiting requests and
cache figures) change with every task; :func:`shape_of` is a status without
them, so that the receiver can tell a load-only change (coalesced) from one
that changes what can be routed (sent at once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from protocol.grpc_metadata import Metadata
from protocol.pb import internal_pb2, status_pb2
from protocol.processor_types import EngineKey, RemoteProtocolError

__all__ = [
    "STATUS_DELTA_HEADER",
    "STATUS_DELTA_METADATA",
    "ReportRead",
    "ReportReader",
    "ReportWriter",
    "offers_deltas",
    "shape_of",
]

#: Response-header key by which a sender (the server of ProcessTasksInternal) says it reads deltas.
STATUS_DELTA_HEADER = "x-infx-status-delta"
#: What an infx sender puts in its response headers.
STATUS_DELTA_METADATA: Metadata = ((STATUS_DELTA_HEADER, "1"),)


def offers_deltas(metadata: Metadata) -> bool:
    """Whether a sender's response headers say it reads status deltas."""
    for key, value in metadata:
        if key == STATUS_DELTA_HEADER:
            return (value.decode("latin-1") if isinstance(value, bytes) else value).strip() == "1"
    return False


def shape_of(status: status_pb2.EngineStatus) -> bytes:
    """``status`` without its load counts, serialized: equal shapes route alike."""
    shape = status_pb2.EngineStatus()
    shape.CopyFrom(status)
    for model in shape.models:
        model.in_progress_task_count = 0
        if model.HasField("runtime_load"):
            load = model.runtime_load
            load.running_requests = load.waiting_requests = 0
            load.ClearField("kv_cache_usage")
            load.ClearField("prefix_cache_hit_rate")
            if not load.ListFields():
                model.ClearField("runtime_load")
    data: bytes = shape.SerializeToString(deterministic=True)
    return data


class ReportWriter:
    """What one stream has reported: builds the next report, full or delta.

    ``deltas`` is set once the sender's headers offered them; until then, and
    whenever a delta would be no smaller, the report is a full snapshot.
    """

    def __init__(self, pod_name: str) -> None:
        self.pod_name = pod_name
        self.deltas = False
        self.sequence = 0
        # Per engine: (its serialized status, its shape) as last reported.
        self._engines: dict[tuple[str, str], tuple[bytes, bytes]] = {}
        self._counts: dict[str, int] = {}
        self._draining: bool | None = None

    def urgent(self, statuses: Iterable[tuple[str, status_pb2.EngineStatus]], draining: bool) -> bool:
        """Whether the peer must hear now: an engine came or went, or changed beyond its load counts."""
        if draining != self._draining:
            return True
        seen = 0
        for tenant, status in statuses:
            seen += 1
            last = self._engines.get((tenant, status.engine_id))
            if last is None or last[1] != shape_of(status):
                return True
        return seen != len(self._engines)

    def report(self, statuses: Iterable[tuple[str, status_pb2.EngineStatus]], counts: Mapping[str, int],
               draining: bool, force: bool) -> internal_pb2.ServerStatus | None:
        """The next report, or None if nothing changed (and not ``force``): full unless deltas
        were offered and the delta is smaller."""
        current = {(tenant, s.engine_id): s for tenant, s in statuses}
        wire = {key: s.SerializeToString(deterministic=True) for key, s in current.items()}
        changed = [key for key, data in wire.items() if key not in self._engines or self._engines[key][0] != data]
        removed = [key for key in self._engines if key not in current]
        new_counts = {model: count for model, count in counts.items() if self._counts.get(model) != count}
        if not (force or changed or removed or new_counts or draining != self._draining):
            return None
        self.sequence += 1
        report = internal_pb2.ServerStatus(pod_name=self.pod_name, draining=draining, sequence=self.sequence)
        full = force or not self.deltas or self._draining is None or len(changed) + len(removed) >= len(current)
        if full:
            report.model_requests_started.update(counts)
            for key in sorted(current):
                report.engine_statuses.add(engine_status=current[key], tenant_id=key[0])
        else:
            report.delta = True
            report.model_requests_started.update(new_counts)
            for key in sorted(changed):
                report.engine_statuses.add(engine_status=current[key], tenant_id=key[0])
            for tenant, engine_id in sorted(removed):
                report.removed_engines.add(engine_id=engine_id, tenant_id=tenant)
        for key in changed:
            self._engines[key] = (wire[key], shape_of(current[key]))
        for key in removed:
            del self._engines[key]
        self._counts = dict(counts)
        self._draining = draining
        return report


@dataclass(frozen=True, slots=True)
class ReportRead:
    """What one report changed on the reading side: engines reported (each whole) and engines
    gone; ``full``: it replaced everything (engines not in it are gone too, and listed so)."""

    full: bool
    upserted: tuple[EngineKey, ...]
    removed: tuple[EngineKey, ...]
    draining_changed: bool


class ReportReader:
    """What a peer's stream has reported so far, merged from its full snapshots and deltas."""

    def __init__(self) -> None:
        #: Every engine the peer reports now, as it reported it.
        self.engines: dict[EngineKey, status_pb2.EngineStatus] = {}
        #: Requests per model the peer accepted from its clients since it started.
        self.requests_started: dict[str, int] = {}
        self.draining = False
        self._sequence = 0
        self._read_full = False

    def read(self, status: internal_pb2.ServerStatus) -> ReportRead | None:
        """Merge one report; None for a repeat of one already read.

        Raises :class:`RemoteProtocolError` for a delta before any full report, or out of sequence, and
        for an engine without an id.
        """
        if status.sequence and status.sequence <= self._sequence:
            return None
        if any(not entry.engine_status.engine_id for entry in status.engine_statuses) or any(
                not removed.engine_id for removed in status.removed_engines):
            raise RemoteProtocolError("peer's status report names an engine without an engine_id")
        if status.delta:
            if not self._read_full:
                raise RemoteProtocolError("peer sent a status delta before any full status report")
            if status.sequence != self._sequence + 1:
                raise RemoteProtocolError(
                    f"peer's status report {status.sequence} follows {self._sequence}: a report was lost")
        elif status.removed_engines:
            raise RemoteProtocolError("peer's full status report lists removed engines")
        self._sequence = status.sequence
        draining_changed = status.draining != self.draining
        self.draining = status.draining
        upserted: list[EngineKey] = []
        reported: dict[EngineKey, status_pb2.EngineStatus] = {}
        for entry in status.engine_statuses:
            key = EngineKey(entry.tenant_id, entry.engine_status.engine_id)
            copy = status_pb2.EngineStatus()
            copy.CopyFrom(entry.engine_status)
            reported[key] = copy
            upserted.append(key)
        if status.delta:
            removed = [EngineKey(r.tenant_id, r.engine_id) for r in status.removed_engines]
            for key in removed:
                self.engines.pop(key, None)
            self.engines.update(reported)
            self.requests_started.update(status.model_requests_started)
        else:
            removed = [key for key in self.engines if key not in reported]
            self.engines = reported
            self.requests_started = dict(status.model_requests_started)
            self._read_full = True
        return ReportRead(not status.delta, tuple(upserted), tuple(removed), draining_changed)
