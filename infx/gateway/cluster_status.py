"""What ``/admin/status`` (and the operator page, through its SSE form) shows: the cluster as this gateway sees it.

Rules this file keeps: it reads and never changes. Everything comes from public
queries of the gateway's parts, so that the parts may change inside without
this view noticing: the processor's (``engine_reports``, ``status``,
``waiting_counts``, ``in_flight_counts``, ``slots_held``, ``criticality_counts``),
the gateway core's (``peers``, ``models_gone``, ``learning``), the exchanger's
streams and status traffic, the scaler's queries, and the gateway's own
records of its requests (:mod:`protocol.gateway.recent`,
:mod:`protocol.gateway.timeline`), which :class:`RequestJournal` keeps.

Scope: a tenant's admin key sees that tenant's engines, models, tasks,
requests and charts alone; ``admin: cluster`` (or auth off) sees every
tenant. Gateways (this one and its peers) are shown to both, with engine
counts in scope. Every field is documented in ``docs/admin.md``, and a test
holds that document and this output to each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime

from protocol.gateway.core import GatewayCore
from protocol.gateway.dialling import DialState
from protocol.gateway.recent import RecentConfig, RecentRequests, RequestRecord
from protocol.gateway.timeline import Timeline, TimelineConfig
from protocol.pb import status_pb2
from protocol.processor.fair_queue import Criticality
from protocol.processor.engines import EngineReport
from protocol.processor.keys import Locality

__all__ = ["ClusterStatus", "RequestJournal", "StatusSources"]

#: Failures listed in a status (the newest; the journal keeps more for the search).
FAILURES_SHOWN = 50


class RequestJournal:
    """The gateway's records of the requests that ended: the ring searched by id, and the timeline.

    :meth:`ended` is called once per request (by its trace, when it ends) and
    :meth:`sample_routing` every bucket by the status's timer; both cost a few
    dictionary operations.
    """

    def __init__(self, recent: RecentConfig | None = None, timeline: TimelineConfig | None = None) -> None:
        self.recent = RecentRequests(recent)
        self.timeline = Timeline(timeline)
        self._routing_seen: dict[tuple[str, str, str], int] = {}

    def ended(self, record: RequestRecord, model_label: str) -> None:
        """A request ended; ``model_label`` is its model as the metrics label it (bounded)."""
        self.recent.add(record)
        if not record.model:
            return  # refused before it named a model (no key, a bad body): no model's chart to count in
        self.timeline.request_ended(record.tenant or "-", model_label, record.status, record.first_token_seconds,
                                    record.tokens_in, record.tokens_out, record.ended_at)

    def sample_routing(self, decisions: Mapping[tuple[str, str, str], int], now: float) -> None:
        """The processor's routing decisions so far: what grew since the last sample goes in the timeline."""
        grown: dict[tuple[str, str], dict[str, int]] = {}
        for key, count in decisions.items():
            delta = count - self._routing_seen.get(key, 0)
            if delta > 0:
                tenant, model, decision = key
                grown.setdefault((tenant, model), {})[decision] = delta
        self._routing_seen = dict(decisions)
        for (tenant, model), counts in grown.items():
            self.timeline.routed(tenant, model, counts, now)
        self.timeline.forget_idle(now)


@dataclass
class StatusSources:
    """The gateway's parts this view reads (see the module docstring); each is only read."""

    core: GatewayCore
    #: The pod of the gateway a route leads to (this one's for a local engine).
    gateway_of: Callable[[object], str]
    journal: RequestJournal
    version: str
    started_at: float
    #: Where this gateway's peer port listens (None: not yet).
    address: Callable[[], str | None]
    #: Whether /readyz says ready, and whether the gateway is shutting down.
    ready: Callable[[], bool]
    draining: Callable[[], bool]
    #: The exchanger (None: a gateway without peers): ``streams``, ``reports_received``, ``reports_sent``.
    exchanger: Any = None
    #: The scaler's machine (None without ``--scaler``) and whether it could start (tenant, model).
    scaler: Any = None
    can_start: Callable[[str, str], bool] | None = None
    #: Requests being served now, by request id: (tenant, its handle's facts).
    in_flight: Callable[[], Iterable[tuple[str, str, Any]]] = lambda: ()
    #: The engine slot cap (None: none) and the routing policy's name.
    max_in_flight_per_engine: int | None = None
    routing_policy: str = ""


class ClusterStatus:
    """Builds the ``/admin/status`` document; see the module docstring."""

    def __init__(self, clock: IReactorTime, sources: StatusSources) -> None:
        self.clock = clock
        self.sources = sources

    @property
    def pod_name(self) -> str:
        return self.sources.core.config.pod_name

    def sample_routing(self) -> None:
        """Put the routing decisions made since the last call in the timeline (once a bucket)."""
        self.sources.journal.sample_routing(self.sources.core.processor.routing_decisions(), self.clock.seconds())

    def status(self, tenant: str | None = None, request_id: str | None = None) -> dict[str, Any]:
        """The document, every tenant's or ``tenant``'s alone; with ``request_id``, its search too."""
        now = self.clock.seconds()
        processor = self.sources.core.processor
        reports = processor.engine_reports(tenant)
        dump = processor.status(tenant)
        out: dict[str, Any] = {
            "generated_at": now,
            "scope": tenant,
            "gateway": self._gateway(now, tenant),
            "gateways": self._gateways(now, reports),
            "tenants": self._tenants(now, tenant, reports),
            "waiting": dump["waiting"],
            "retry_pending": dump["retry_pending"],
            "tasks": dump["tasks"],
            "failures": [self._record(r) for r in self.sources.journal.recent.failures(tenant, FAILURES_SHOWN)],
            "series": self.sources.journal.timeline.series(now, None if tenant is None else [tenant]),
        }
        if request_id is not None:
            out["request"] = self.find(request_id, tenant)
        return out

    # --- this gateway and its peers ------------------------------------------------

    def _gateway(self, now: float, tenant: str | None) -> dict[str, Any]:
        core = self.sources.core
        state = "draining" if self.sources.draining() else "learning" if core.learning(now) else "serving"
        in_flight = sum(1 for owner, _, _ in self.sources.in_flight() if tenant is None or owner == tenant)
        return {
            "pod": self.pod_name,
            "version": self.sources.version,
            "state": state,
            "ready": self.sources.ready(),
            "started_at": self.sources.started_at,
            "routing_policy": self.sources.routing_policy,
            "max_in_flight_per_engine": self.sources.max_in_flight_per_engine,
            "requests_in_flight": in_flight,
        }

    def _gateways(self, now: float, reports: list[EngineReport]) -> dict[str, Any]:
        """This gateway and every peer, by pod: what our dial to it and its dial to us say."""
        engines: dict[str, int] = {}
        for report in reports:
            pod = self.sources.gateway_of(report.route)
            engines[pod] = engines.get(pod, 0) + 1
        exchanger = self.sources.exchanger
        received: Mapping[str, Any] = exchanger.reports_received if exchanger is not None else {}
        sent_by_dial: Mapping[str, Any] = exchanger.reports_sent if exchanger is not None else {}
        accepted = {s.pod_name: s for s in exchanger.streams if s.pod_name} if exchanger is not None else {}
        dialled = {(peer.pod_name or name): peer for name, peer in self.sources.core.peers.items()}
        me = self._gateway(now, None)["state"]
        out: dict[str, Any] = {self.pod_name: {
            "self": True, "address": self.sources.address(), "state": me, "dial": None, "dialled_in": False,
            "last_report_age_seconds": None, "status_traffic": _traffic(None, None),
            "engines": engines.get(self.pod_name, 0), "forwarded_in_flight": 0,
        }}
        for pod in sorted(set(dialled) | set(accepted) | set(received)):
            if pod == self.pod_name:
                continue
            peer, stream, read = dialled.get(pod), accepted.get(pod), received.get(pod)
            if peer is None and stream is None:
                continue  # a peer that is gone: its traffic stays counted, it is not listed
            dial = peer.state if peer is not None else None
            last = None if read is None or read.last_report_at is None else round(now - read.last_report_at, 3)
            address = str(peer.address) if peer is not None else str(stream.call.peer) if stream is not None else None
            out[pod] = {
                "self": False,
                "address": address,
                "state": _peer_state(dial, stream),
                "dial": None if dial is None else dial.value,
                "dialled_in": stream is not None,
                "last_report_age_seconds": last,
                "status_traffic": _traffic(read, sent_by_dial.get(peer.name) if peer is not None else None),
                "engines": engines.get(pod, 0),
                "forwarded_in_flight": peer.dialled.tasks_in_flight if peer is not None and peer.dialled else 0,
            }
        return out

    # --- tenants, their engines and models -------------------------------------------

    def _tenants(self, now: float, tenant: str | None, reports: list[EngineReport]) -> dict[str, Any]:
        processor = self.sources.core.processor
        waiting = processor.waiting_counts()
        in_flight = processor.in_flight_counts()
        criticality = processor.criticality_counts()
        refusals = self.sources.journal.recent.rate_limited
        names = {r.key.tenant_id for r in reports} | {t for t, _ in waiting} | {t for t, _ in in_flight} \
            | {t for t, _ in criticality} | set(refusals)
        if tenant is not None:
            names = {tenant}
        out: dict[str, Any] = {}
        for name in sorted(names):
            mine = [r for r in reports if r.key.tenant_id == name]
            models = self._models(now, name, mine, waiting, in_flight)
            held: dict[str, int] = {}
            for model in models:
                for flow, count in processor.slots_held(name, model).items():
                    held[flow] = held.get(flow, 0) + count
            total_held = sum(held.values())
            out[name] = {
                "engines": {r.key.engine_id: self._engine(r) for r in mine},
                "models": models,
                "in_flight": sum(n for (t, _), n in in_flight.items() if t == name),
                "waiting": sum(n for (t, _), n in waiting.items() if t == name),
                "slots_held": held,
                "slot_share": {flow: round(count / total_held, 3) for flow, count in held.items()},
                "criticality": {c.value: criticality.get((name, c.value), 0) for c in Criticality},
                "rate_limit_refusals": refusals.get(name, 0),
            }
        return out

    def _engine(self, report: EngineReport) -> dict[str, Any]:
        status = report.status
        loads = [m.runtime_load for m in status.models if m.HasField("runtime_load")]
        route = report.route
        return {
            "engine_id": status.engine_id,
            "gateway": self.sources.gateway_of(route),
            "locality": report.locality.value,
            "address": str(getattr(route, "peer", "")) or None if report.locality is Locality.LOCAL else None,
            "ready": status.ready,
            "routable": report.routable,
            "draining": report.draining,
            "busy_until": report.busy_until,
            "cluster_id": status.cluster_id,
            "runtime": _runtime(status),
            "models": [
                {"id": m.id, "ready": m.is_ready, "in_progress": m.in_progress_task_count,
                 "adapter": m.is_dynamically_loaded_lora,
                 "prompt_cache": _prompt_cache(m.infx_prompt_cache) if m.HasField("infx_prompt_cache") else None}
                for m in sorted(status.models, key=lambda m: m.id)
            ],
            "adapters": sorted({a for load in loads for a in load.loaded_adapters}),
            "load": _load(loads[0]) if loads else None,
            "slot_keeping": _slot_keeping(status.infx_slot_keeping) if status.HasField("infx_slot_keeping") else None,
            "slots": {"cap": self.sources.max_in_flight_per_engine, "used": report.load},
            "tasks": list(report.tasks),
            "waiting": list(report.waiting),
        }

    def _models(self, now: float, tenant: str, reports: list[EngineReport], waiting: Mapping[tuple[str, str], int],
                in_flight: Mapping[tuple[str, str], int]) -> dict[str, Any]:
        listing: dict[str, list[tuple[EngineReport, bool]]] = {}
        for report in reports:
            for model in report.status.models:
                listing.setdefault(model.id, []).append((report, report.routable and model.is_ready))
        gone = self.sources.core.models_gone(tenant, now)
        scaled = self._scaled_models(tenant)
        names = set(listing) | set(gone) | set(scaled) | {m for t, m in waiting if t == tenant} \
            | {m for t, m in in_flight if t == tenant}
        out: dict[str, Any] = {}
        for model in sorted(names):
            engines = listing.get(model, [])
            scaler = scaled.get(model)
            if any(ready for _, ready in engines):
                state = "served"
            elif engines:
                state = "loading"
            elif scaler is not None and (scaler["phase"] != "idle" or scaler["held"]):
                state = "starting"
            elif scaler is not None:
                state = "startable"
            elif model in gone:
                state = "gone"
            else:
                state = "unknown"
            out[model] = {
                "state": state,
                "engines": len(engines),
                "engines_ready": sum(1 for _, ready in engines if ready),
                "waiting": waiting.get((tenant, model), 0),
                "in_flight": in_flight.get((tenant, model), 0),
                "scaler": scaler,
            }
        return out

    def _scaled_models(self, tenant: str) -> dict[str, dict[str, Any]]:
        """The scaler's deployments for each model the tenant could have started."""
        scaler, can_start = self.sources.scaler, self.sources.can_start
        if scaler is None or can_start is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for key in scaler.deployments():
            snapshot = scaler.snapshot(key)
            if snapshot is None:
                continue
            for model in snapshot.models:
                if model in out or not can_start(tenant, model):
                    continue
                out[model] = {
                    "deployment": str(key),
                    "replicas": snapshot.replicas,
                    "available_replicas": snapshot.available_replicas,
                    "desired_replicas": scaler.desired(key),
                    "phase": scaler.phase(key).value,
                    "held": scaler.held_count(key),
                    "leading": scaler.leading,
                }
        return out

    # --- requests ---------------------------------------------------------------------

    def find(self, request_id: str, tenant: str | None) -> dict[str, Any] | None:
        """A request by id, in scope: one being served now, else the newest of that id remembered."""
        for owner, found_id, call in self.sources.in_flight():
            if found_id == request_id and (tenant is None or owner == tenant):
                served = getattr(getattr(call, "handle", None), "served_by", None)
                return {
                    "request_id": request_id, "tenant": owner, "endpoint": call.endpoint, "model": call.model,
                    "state": "in_progress", "started_at": call.started_at, "ended_at": None, "status": None,
                    "error": None, "detail": None, "latency_seconds": None,
                    "queued_seconds": served.queued_seconds if served else None,
                    "first_token_seconds": None, "tokens_in": None, "tokens_out": None,
                    "retries": served.retries if served else 0,
                    "route": self._route(served.gateway if served else "", served.engine_id if served else ""),
                }
        record = self.sources.journal.recent.find(request_id, tenant)
        return None if record is None else self._record(record)

    def _record(self, record: RequestRecord) -> dict[str, Any]:
        return {
            "request_id": record.request_id, "tenant": record.tenant, "endpoint": record.endpoint,
            "model": record.model, "state": "ended", "started_at": record.started_at, "ended_at": record.ended_at,
            "status": record.status, "error": record.error or None, "detail": record.detail or None,
            "latency_seconds": round(record.ended_at - record.started_at, 6),
            "queued_seconds": record.queued_seconds, "first_token_seconds": record.first_token_seconds,
            "tokens_in": record.tokens_in, "tokens_out": record.tokens_out, "retries": record.retries,
            "route": self._route(record.served_by, record.engine_id),
        }

    def _route(self, served_by: str, engine_id: str) -> dict[str, Any]:
        """Gateway -> peer (when a peer's engine served it) -> engine."""
        peer = served_by if served_by and served_by != self.pod_name else None
        return {"gateway": self.pod_name, "peer": peer, "engine": engine_id or None}


def _peer_state(dial: DialState | None, stream: Any) -> str:
    """connected: its report arrived and our dial is open (or it is not dialled: one-way);
    draining: its reports say it shuts down; learning: a stream is up but its engines are not
    known here yet; connecting / unreachable: no stream either way, our dial is opening / backing off."""
    if stream is not None and stream.draining:
        return "draining"
    if stream is not None and dial in (None, DialState.OPEN, DialState.DRAINING):
        return "connected"
    if stream is not None or dial is DialState.OPEN:
        return "learning"
    return "connecting" if dial is DialState.CONNECTING else "unreachable"


def _traffic(read: Any, sent: Any) -> dict[str, int]:
    return {
        "reports_received": read.reports_received if read is not None else 0,
        "bytes_received": read.bytes_received if read is not None else 0,
        "reports_sent": sent.reports_sent if sent is not None else 0,
        "bytes_sent": sent.bytes_sent if sent is not None else 0,
    }


def _runtime(status: status_pb2.EngineStatus) -> dict[str, Any] | None:
    if not status.HasField("infx_runtime"):
        return None
    info = status.infx_runtime
    return {"kind": info.kind or None, "version": info.version or None, "agent_version": info.agent_version or None,
            "name": status.infx_runtime_name or None}


def _load(load: status_pb2.EngineStatus.RuntimeLoad) -> dict[str, Any]:
    return {
        "running": load.running_requests,
        "waiting": load.waiting_requests,
        "kv_cache_usage": load.kv_cache_usage if load.HasField("kv_cache_usage") else None,
        "prefix_cache_hit_rate": load.prefix_cache_hit_rate if load.HasField("prefix_cache_hit_rate") else None,
        "source": load.source or None,
    }


def _prompt_cache(cache: status_pb2.EngineStatus.PromptCache) -> dict[str, Any]:
    return {
        "answers": cache.answers,
        "prompt_tokens": cache.prompt_tokens,
        "cached_tokens": cache.cached_tokens,
        "cached_share": round(cache.cached_tokens / cache.prompt_tokens, 3) if cache.prompt_tokens else None,
    }


def _slot_keeping(keeping: status_pb2.EngineStatus.SlotKeeping) -> dict[str, Any]:
    return {"held": keeping.held, "restored": keeping.restored, "cold": keeping.cold, "failed": keeping.failed,
            "saved": keeping.saved, "off": keeping.off}
