"""The engine table: every engine the processor knows (local or a peer's), indexed by tenant and
by (tenant, model), with their runtimes' busy back-offs; pure, no I/O, no clock reads.

Rules this file keeps: an engine enters with :meth:`EngineTable.add` and leaves with
:meth:`EngineTable.remove`; the models it lists and has ready change only through
:meth:`EngineTable.index` (the one place they do), which keeps the (tenant, model) index with
them, so that asking whether a model is served costs the engines of that model, not every
engine. What routing knows of engines is the router's (:mod:`protocol.routing.pools`); the
processor tells it every change.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterator, ValuesView
from dataclasses import dataclass, field

from protocol.openai import task_forms
from protocol.pb import status_pb2
from protocol.processor.keys import EngineKey, Locality, Route

__all__ = ["EngineRecord", "EngineReport", "EngineTable", "EngineView"]


@dataclass(slots=True)
class EngineRecord:
    """What the processor knows of one engine."""

    key: EngineKey
    route: Route
    locality: Locality
    status: status_pb2.EngineStatus
    ready_models: frozenset[str] = frozenset()
    # Every model its status lists, ready or loading (kept with ``ready_models`` by ``EngineTable.index``).
    listed_models: frozenset[str] = frozenset()
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    pending_heartbeat: str | None = None
    missed_heartbeats: int = 0
    # Set while the engine's runtime said it is busy: routing skips it until then.
    busy_until: float | None = None

    @property
    def routable(self) -> bool:
        return self.status.ready and not self.draining


@dataclass(frozen=True, slots=True)
class EngineView:
    """A read-only snapshot of one engine: ``routable`` is ready and not told to go away."""

    key: EngineKey
    route: Route
    locality: Locality
    routable: bool
    in_flight: int


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine as the operator's view shows it: what it reported last (``status``, never
    to be changed by the reader) and how this processor holds it."""

    key: EngineKey
    route: Route
    locality: Locality
    status: status_pb2.EngineStatus
    routable: bool
    draining: bool
    #: Until when its runtime's busy answer keeps it out of routing (None: not busy).
    busy_until: float | None
    #: Tasks on it now, and peers' tasks waiting here for a slot on it.
    tasks: tuple[str, ...]
    waiting: tuple[str, ...]
    #: The load routing counts for it (its tasks, or what it reported, whichever is more).
    load: int


_NO_ENGINES: dict[str, EngineRecord] = {}


class EngineTable:
    """Engines by key, by tenant and by (tenant, model), and when busy runtimes may be asked again."""

    def __init__(self) -> None:
        self._by_key: dict[EngineKey, EngineRecord] = {}
        #: The engine of a key, or None (the dict's own ``get``: routing asks it of every candidate).
        self.get: Callable[[EngineKey], EngineRecord | None] = self._by_key.get
        self._by_tenant: dict[str, dict[str, EngineRecord]] = {}
        #: tenant -> model -> the tenant's engines that list it / that have it ready (see ``index``).
        self.listing: dict[str, dict[str, dict[EngineKey, EngineRecord]]] = {}
        self.ready_for: dict[str, dict[str, dict[EngineKey, EngineRecord]]] = {}
        # (busy_until, seq, engine): when an engine's busy back-off ends.
        self._backoffs: list[tuple[float, int, EngineKey]] = []
        self._backoff_seq = 0
        #: ``typed_form_wanted``'s answers (asked by every request), until an engine changes.
        self._typed_wanted: dict[tuple[str, str, bool], bool] = {}

    # --- the mapping of engines ---------------------------------------------

    def __getitem__(self, key: EngineKey) -> EngineRecord:
        return self._by_key[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def values(self) -> ValuesView[EngineRecord]:
        return self._by_key.values()

    def items(self) -> Iterator[tuple[EngineKey, EngineRecord]]:
        return iter(self._by_key.items())

    def of_tenant(self, tenant_id: str) -> dict[str, EngineRecord]:
        """The tenant's engines by engine id (read only)."""
        return self._by_tenant.get(tenant_id, _NO_ENGINES)

    def on_route(self, route: Route) -> list[EngineRecord]:
        """The engines registered on ``route``."""
        return [e for e in self._by_key.values() if e.route == route]

    def local(self) -> list[EngineRecord]:
        """The engines attached to this gateway."""
        return [e for e in self._by_key.values() if e.locality is Locality.LOCAL]

    # --- changes ----------------------------------------------------------------

    def add(self, engine: EngineRecord) -> None:
        """A new engine, with no models indexed yet."""
        self._by_key[engine.key] = engine
        self._by_tenant.setdefault(engine.key.tenant_id, {})[engine.key.engine_id] = engine
        self._typed_wanted.clear()

    def remove(self, engine: EngineRecord) -> None:
        """``engine`` leaves the tables and the index."""
        del self._by_key[engine.key]
        self.index(engine, frozenset(), frozenset())
        tenant = self._by_tenant[engine.key.tenant_id]
        del tenant[engine.key.engine_id]
        if not tenant:
            del self._by_tenant[engine.key.tenant_id]

    def index(self, engine: EngineRecord, listed: frozenset[str], ready: frozenset[str]) -> None:
        """Set the models an engine lists and has ready, and the (tenant, model) index with them
        (both empty: it leaves the index)."""
        tenant, key = engine.key.tenant_id, engine.key
        self._typed_wanted.clear()  # the engine's status, and so what it takes, may have changed too
        for table, old, new in ((self.listing, engine.listed_models, listed),
                                (self.ready_for, engine.ready_models, ready)):
            models = table.setdefault(tenant, {})
            for model in old - new:
                holders = models[model]
                del holders[key]
                if not holders:
                    del models[model]
            for model in new - old:
                models.setdefault(model, {})[key] = engine
            if not models:
                del table[tenant]
        engine.listed_models, engine.ready_models = listed, ready

    # --- busy runtimes --------------------------------------------------------

    def back_off(self, engine: EngineRecord, until: float) -> None:
        """``engine``'s runtime is busy: it gets no task until ``until`` (a later time wins)."""
        if engine.busy_until is None or until > engine.busy_until:
            engine.busy_until = until
            self._backoff_seq += 1
            heapq.heappush(self._backoffs, (until, self._backoff_seq, engine.key))

    def next_backoff(self) -> float | None:
        """When the next back-off ends (it may have been superseded), if any."""
        return self._backoffs[0][0] if self._backoffs else None

    def backoffs_over(self, now: float) -> Iterator[EngineRecord]:
        """The engines whose back-off ended by ``now``, in order; they may be asked again."""
        while self._backoffs and self._backoffs[0][0] <= now:
            until, _, key = heapq.heappop(self._backoffs)
            engine = self._by_key.get(key)
            if engine is not None and engine.busy_until == until:
                engine.busy_until = None
                yield engine

    # --- queries ---------------------------------------------------------------

    def tenants(self) -> list[str]:
        """Tenants with at least one engine registered, sorted."""
        return sorted(self._by_tenant)

    def by_tenant(self) -> list[tuple[str, dict[str, EngineRecord]]]:
        """Each tenant's engines by id, tenants sorted."""
        return sorted(self._by_tenant.items())

    def counts(self, routable_only: bool = False) -> dict[tuple[str, Locality], int]:
        """Engines (with ``routable_only``, those that take tasks now) per (tenant, locality)."""
        return dict(Counter((e.key.tenant_id, e.locality) for e in self._by_key.values()
                            if e.routable or not routable_only))

    def view(self, key: EngineKey) -> EngineView | None:
        """What the processor knows of one engine, or None if it is not registered."""
        engine = self._by_key.get(key)
        if engine is None:
            return None
        return EngineView(engine.key, engine.route, engine.locality, engine.routable, len(engine.in_flight))

    def takes_http_request(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant that lists the model (ready or not) runs verbatim requests."""
        listing = self.listing.get(tenant_id, {}).get(model_id, {})
        return any(task_forms.takes_http_request(e.status) for e in listing.values())

    def typed_form_wanted(self, tenant_id: str, model_id: str, any_engine: bool) -> bool:
        """Whether an engine that may get a task for the model (one that lists it; with
        ``any_engine``, one of the tenant's) takes only the typed form, or none is known yet."""
        # With ``any_engine`` the answer is the tenant's, whatever the model.
        cache_key = (tenant_id, "" if any_engine else model_id, any_engine)
        known = self._typed_wanted.get(cache_key)
        if known is not None:
            return known
        engines: Collection[EngineRecord] = (
            self._by_tenant.get(tenant_id, _NO_ENGINES).values() if any_engine
            else self.listing.get(tenant_id, {}).get(model_id, {}).values())
        if not engines:
            return True  # not kept: the model named by a request may be any string
        wanted = not all(task_forms.takes_http_request(e.status) for e in engines)
        self._typed_wanted[cache_key] = wanted
        return wanted

    def serves(self, tenant_id: str, model_id: str) -> bool:
        """Whether an engine of the tenant lists the model (ready or loading)."""
        return model_id in self.listing.get(tenant_id, {})

    def known_models(self, tenant_id: str, ready_only: bool = False) -> set[str]:
        """Models the tenant's engines list (loading ones too); with ``ready_only``,
        only those a task could be routed to now."""
        if not ready_only:
            return set(self.listing.get(tenant_id, {}))
        return {model for model, engines in self.ready_for.get(tenant_id, {}).items()
                if any(engine.routable for engine in engines.values())}
