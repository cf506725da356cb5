"""Status reports between gateways: full snapshots for every peer, deltas for infx peers.

No I/O, no clock reads. Both ends of a ``ProcessTasksInternal`` stream keep
here what the stream has reported so far: the dialled peer (which reports its
local engines) in a :class:`ReportWriter`, the accepted peer (which registers them)
in a :class:`ReportReader`. The local engines themselves are a
:class:`LocalStatuses`, shared by every dialled peer of a gateway.

LLMariner's dialled peer re-sends every engine on every change, to every peer:
with ``g`` gateways of ``e`` engines each, one change costs ``g`` reports of
``e`` engines. An infx accepted peer says in the stream's response headers that it
reads deltas (:data:`STATUS_DELTA_HEADER`); only then does the writer send,
after the full snapshot every stream starts with, reports that carry the
engines that changed and the ids of those removed (ServerStatus fields
102-104). A LLMariner accepted peer never says so and gets full snapshots, as today.

Every report is numbered on its stream (field 104). The stream is ordered
and reliable, so a gap means a report was lost by a bug somewhere: the reader
refuses the stream (:class:`PeerProtocolError`) and the dialled peer's redial
starts again with a full snapshot; a number already read is a repeat and is
skipped. No periodic full snapshot is sent: it would cost every engine on
every peer per period for nothing a numbered ordered stream can lose, and
every new stream starts with one.

Load counts (in-progress tasks, the runtime's running/waiting requests and
cache figures, the slot keeper's counts) change with every task; :func:`shape_of` is a status without
them, so that the dialled peer can tell a load-only change (coalesced) from one
that changes what can be routed (sent at once). The answers' prompt cache
counts (``infx_prompt_cache``) are part of the shape: an engine whose runtime
says its cached tokens (llama.cpp) has its status sent at once after every
answer, which the real runs with three gateways were measured with
(docs/routing-real.md); coalescing them too delays peers' loads to the relay
interval and changes where those runs place requests, a change to measure first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from protocol.grpc.metadata import Metadata
from protocol.pb import internal_pb2, status_pb2
from protocol.processor.errors import PeerProtocolError
from protocol.processor.keys import EngineKey

__all__ = [
    "STATUS_DELTA_HEADER",
    "STATUS_DELTA_METADATA",
    "LocalStatuses",
    "ReportRead",
    "ReportReader",
    "ReportWriter",
    "offers_deltas",
    "shape_of",
]

#: Response-header key by which an accepted peer (the server of ProcessTasksInternal) says it reads deltas.
STATUS_DELTA_HEADER = "x-infx-status-delta"
#: What an infx accepted peer puts in its response headers.
STATUS_DELTA_METADATA: Metadata = ((STATUS_DELTA_HEADER, "1"),)


def offers_deltas(metadata: Metadata) -> bool:
    """Whether an accepted peer's response headers say it reads status deltas."""
    for key, value in metadata:
        if key == STATUS_DELTA_HEADER:
            return (value.decode("latin-1") if isinstance(value, bytes) else value).strip() == "1"
    return False


def shape_of(status: status_pb2.EngineStatus) -> bytes:
    """``status`` without its load counts, serialized: equal shapes route alike."""
    shape = status_pb2.EngineStatus()
    shape.CopyFrom(status)
    shape.ClearField("infx_slot_keeping")
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


class _Local:
    """One local engine as the dialled peers report it: its status, serialized, and its shape, built once
    per change and shared by every stream; the variant a draining gateway reports (not ready) on demand."""

    __slots__ = ("status", "wire", "_shape", "_draining")

    def __init__(self, status: status_pb2.EngineStatus, wire: bytes) -> None:
        self.status = status
        self.wire = wire
        self._shape: bytes | None = None
        self._draining: _Local | None = None

    def shape(self) -> bytes:
        """:func:`shape_of` its status, computed once."""
        if self._shape is None:
            self._shape = shape_of(self.status)
        return self._shape

    def view(self, draining: bool) -> _Local:
        """This engine as reported by a gateway that is (or is not) draining: not ready when draining."""
        if not draining:
            return self
        if self._draining is None:
            status = status_pb2.EngineStatus()
            status.CopyFrom(self.status)
            status.ready = False
            self._draining = _Local(status, status.SerializeToString(deterministic=True))
        return self._draining


class LocalStatuses:
    """This gateway's local engines as every dialled peer reports them, and which changed when.

    The gateway core refreshes it once per change of its local engines and every dialled peer's
    :class:`ReportWriter` reads it, so that a change costs one copy and serialization of each
    local engine, not one per peer, and a writer compares only the engines that changed since it
    last reported (``changed_since``), not every engine.

    ``generation`` grows by one with every refresh that changed something. The change log keeps,
    per engine (present or removed), the generation of its last change, oldest first; it is
    trimmed to twice the engines plus ``slack`` entries, and ``changed_since`` answers None for a
    generation older than what the log still covers (the writer then compares every engine).
    """

    def __init__(self, slack: int = 16) -> None:
        self._slack = slack
        self.generation = 0
        self._entries: dict[tuple[str, str], _Local] = {}
        self._sorted: list[tuple[str, str]] = []
        self._log: OrderedDict[tuple[str, str], int] = OrderedDict()
        # The log lists every engine that changed after this generation.
        self._horizon = 0

    def refresh(self, statuses: Iterable[tuple[str, status_pb2.EngineStatus]]) -> LocalStatuses:
        """Take the local engines as they are now: (tenant, status) pairs this object may keep and
        change (copies, as ``Processor.local_engines`` returns); each status's models are put in id
        order. Returns itself."""
        generation = self.generation + 1
        entries: dict[tuple[str, str], _Local] = {}
        changed: list[tuple[str, str]] = []
        for tenant, status in statuses:
            models = sorted(status.models, key=lambda m: m.id)
            ordered = [status_pb2.EngineStatus.Model() for _ in models]
            for copy, model in zip(ordered, models):
                copy.CopyFrom(model)
            del status.models[:]
            status.models.extend(ordered)
            key = (tenant, status.engine_id)
            wire = status.SerializeToString(deterministic=True)
            last = self._entries.get(key)
            if last is not None and last.wire == wire:
                entries[key] = last
            else:
                entries[key] = _Local(status, wire)
                changed.append(key)
        changed += [key for key in self._entries if key not in entries]
        if not changed:
            return self
        self.generation = generation
        if len(entries) != len(self._entries) or any(key not in self._entries for key in entries):
            self._sorted = sorted(entries)
        self._entries = entries
        for key in changed:
            self._log[key] = generation
            self._log.move_to_end(key)
        while len(self._log) > 2 * len(entries) + self._slack:
            _, self._horizon = self._log.popitem(last=False)
        return self

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str]) -> _Local | None:
        """Local engine ``key`` as reported when not draining, or None if it is not local now."""
        return self._entries.get(key)

    def view(self, key: tuple[str, str], draining: bool) -> _Local:
        """Local engine ``key`` (one of ``keys``) as a gateway that is (or is not) draining reports it."""
        return self._entries[key].view(draining)

    @property
    def keys(self) -> list[tuple[str, str]]:
        """Every local engine's (tenant, engine id), sorted."""
        return self._sorted

    def changed_since(self, generation: int) -> list[tuple[str, str]] | None:
        """The engines that changed, came or went after ``generation``, newest first; None if the
        log no longer goes back that far."""
        if generation < self._horizon:
            return None
        out = []
        for key, changed_at in reversed(self._log.items()):
            if changed_at <= generation:
                break
            out.append(key)
        return out


class ReportWriter:
    """What one stream has reported: builds the next report, full or delta.

    ``deltas`` is set once the accepted peer's headers offered them; until then, and
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
        # The LocalStatuses, and its generation, that ``_engines`` equals (with ``_draining``'s view).
        self._book: LocalStatuses | None = None
        self._seen = 0

    def urgent(self, local: LocalStatuses, draining: bool) -> bool:
        """Whether the peer must hear now: an engine came or went, or changed beyond its load counts."""
        if draining != self._draining:
            return True
        for key in self._candidates(local, draining):
            entry, last = local.get(key), self._engines.get(key)
            if entry is None:
                if last is not None:
                    return True
            elif last is None or last[1] != entry.view(draining).shape():
                return True
        return False

    def report(self, local: LocalStatuses, counts: Mapping[str, int],
               draining: bool, force: bool) -> internal_pb2.ServerStatus | None:
        """The next report, or None if nothing changed (and not ``force``): full unless deltas
        were offered and the delta is smaller."""
        changed: dict[tuple[str, str], _Local] = {}
        removed: list[tuple[str, str]] = []
        for key in self._candidates(local, draining):
            entry, last = local.get(key), self._engines.get(key)
            if entry is None:
                if last is not None:
                    removed.append(key)
            elif last is None or last[0] != entry.view(draining).wire:
                changed[key] = entry.view(draining)
        new_counts = {model: count for model, count in counts.items() if self._counts.get(model) != count}
        if not (force or changed or removed or new_counts or draining != self._draining):
            self._book, self._seen = local, local.generation
            return None
        self.sequence += 1
        report = internal_pb2.ServerStatus(pod_name=self.pod_name, draining=draining, sequence=self.sequence)
        full = force or not self.deltas or self._draining is None or len(changed) + len(removed) >= len(local)
        if full:
            report.model_requests_started.update(counts)
            for key in local.keys:
                report.engine_statuses.add(engine_status=local.view(key, draining).status, tenant_id=key[0])
        else:
            report.delta = True
            report.model_requests_started.update(new_counts)
            for key in sorted(changed):
                report.engine_statuses.add(engine_status=changed[key].status, tenant_id=key[0])
            for tenant, engine_id in sorted(removed):
                report.removed_engines.add(engine_id=engine_id, tenant_id=tenant)
        for key, view in changed.items():
            self._engines[key] = (view.wire, view.shape())
        for key in removed:
            del self._engines[key]
        self._counts = dict(counts)
        self._draining = draining
        self._book, self._seen = local, local.generation
        return report

    def _candidates(self, local: LocalStatuses, draining: bool) -> Iterable[tuple[str, str]]:
        """Every engine whose report may differ from what this stream last reported: those
        ``local`` changed since, or all of them (another book, another view, a log too short)."""
        if local is self._book and draining == self._draining:
            changed = local.changed_since(self._seen)
            if changed is not None:
                return changed
        return dict.fromkeys([*local.keys, *self._engines])


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

        Raises :class:`PeerProtocolError` for a delta before any full report, or out of sequence, and
        for an engine without an id.
        """
        if status.sequence and status.sequence <= self._sequence:
            return None
        if any(not entry.engine_status.engine_id for entry in status.engine_statuses) or any(
                not removed.engine_id for removed in status.removed_engines):
            raise PeerProtocolError("peer's status report names an engine without an engine_id")
        if status.delta:
            if not self._read_full:
                raise PeerProtocolError("peer sent a status delta before any full status report")
            if status.sequence != self._sequence + 1:
                raise PeerProtocolError(
                    f"peer's status report {status.sequence} follows {self._sequence}: a report was lost")
        elif status.removed_engines:
            raise PeerProtocolError("peer's full status report lists removed engines")
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
