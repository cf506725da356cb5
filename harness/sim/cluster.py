"""The whole cluster in one process: N gateways, M engines, clients, faults, one clock, one seed.

Rules this file keeps: everything random comes from one ``random.Random(seed)``
and everything timed from one :class:`~harness.sim.scheduler.Scheduler`, so a
seed replays exactly. A run has five phases: *faults* (``steps`` scheduler
steps with clients submitting and faults injected), *heal* (faults stop,
dead gateways restart, every request in flight must end), *converge* (every
live gateway must come to route to every up engine), *probe* (one gateway at
a time asks for every model an engine of the tenant serves, and each request
must succeed), *drain* (every count of live tasks must be back to zero).
Invariants are checked after every step, incrementally (:mod:`harness.sim.checks`).
"""

from __future__ import annotations

import hashlib
import random
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.sim.checks import StepChecks
from harness.sim.engine import EngineNode
from harness.sim.faults import Faults
from harness.sim.gateway import SimGateway
from harness.sim.invariants import (
    CONVERGENCE,
    ENDS_ONCE,
    LIVENESS,
    MEMORY,
    NO_CRASH,
    ClientRequest,
    InvariantViolated,
    Ledger,
)
from harness.sim.link import Link
from harness.sim.scheduler import Scheduler
from protocol.pb import chat_pb2, worker_pb2
from protocol.processor.config import ProcessorConfig


@dataclass(frozen=True)
class SimConfig:
    """The shape of a simulated cluster and its load.

    ``steps``: scheduler steps in the fault phase; ``duration``, if set, ends
    the fault phase at that virtual time instead. ``gateways``: gateway
    replicas (full mesh of peer streams). ``engines``: a range; each seed
    draws how many, their tenants and their models; engine ``i`` first dials
    gateway ``i mod gateways`` (spread evenly), later ones wherever the load
    balancer sends them. ``request_interval`` / ``fault_interval``: mean
    virtual seconds between client requests / faults. ``full_checks``:
    recompute every invariant after every step instead of incrementally.
    """

    steps: int = 500
    duration: float | None = None
    gateways: int = 3
    engines: tuple[int, int] = (2, 5)
    tenants: tuple[str, ...] = ("t1", "t2")
    models: tuple[str, ...] = ("m1", "m2")
    request_interval: float = 0.08
    fault_interval: float = 0.6
    latency: tuple[float, float] = (0.0005, 0.02)
    #: Seconds a scripted runtime takes to its first result (uniform in the range).
    runtime_delay: tuple[float, float] = (0.005, 0.3)
    heal_timeout: float = 60.0
    converge_timeout: float = 30.0
    probe_timeout: float = 40.0
    full_checks: bool = False

    def options(self) -> str:
        """The ``tools/sim`` options that give this shape and load (beyond the seed and steps)."""
        default = SimConfig()
        parts = []
        if self.gateways != default.gateways:
            parts.append(f"--gateways {self.gateways}")
        if self.engines != default.engines:
            low, high = self.engines
            parts.append(f"--engines {low}" if low == high else f"--engines {low}-{high}")
        if self.models != default.models:
            parts.append(f"--models {len(self.models)}")
        if self.tenants != default.tenants:
            parts.append(f"--tenants {len(self.tenants)}")
        for name in ("request_interval", "fault_interval", "duration"):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"--{name.replace('_', '-')} {getattr(self, name):g}")
        if self.full_checks:
            parts.append("--full-checks")
        return "".join(f" {part}" for part in parts)


@dataclass
class SimResult:
    """What one seed did; ``violation`` is None when every invariant held."""

    seed: int
    steps: int
    violation: InvariantViolated | None
    #: The shape and load options of the run, as ``tools/sim`` spells them.
    options: str = ""
    stats: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    virtual_time: float = 0.0
    wall_time: float = 0.0
    digest: str = ""

    @property
    def ok(self) -> bool:
        return self.violation is None

    @property
    def replay(self) -> str:
        return f"tools/sim --seed {self.seed} --steps {self.steps}{self.options}"

    def describe(self) -> str:
        if self.violation is None:
            return f"seed {self.seed}: ok"
        return (f"seed {self.seed}: invariant {self.violation.invariant} violated: {self.violation.detail}\n"
                f"  replay: {self.replay}")


class Cluster:
    """Builds the cluster for one seed and runs its phases."""

    def __init__(self, seed: int, config: SimConfig = SimConfig()) -> None:
        self.seed = seed
        self.config = config
        self.rng = random.Random(seed)
        self.scheduler = Scheduler(self.rng)
        self.ledger = Ledger()
        self.checks = StepChecks(self, config.full_checks)
        self.stats: Counter[str] = Counter()
        self.faults = Faults(self, config.fault_interval)
        self.processor_config = ProcessorConfig(
            queue_timeout=5.0, max_task_duration=20.0, max_attempts=4,
            retry_delay=self.rng.choice((0.0, 0.2, 1.0)), heartbeat_interval=3.0, heartbeat_max_missed=2,
        )
        self.gateway_names = [f"gw{i}" for i in range(config.gateways)]
        self.gateways: dict[str, SimGateway] = {}
        self.engines: list[EngineNode] = []
        self.links: list[Link] = []
        self._links_kept = 64
        self._arrivals = False
        self._request_seq = 0
        self.steps = 0
        self._phase_start = (0, 0.0)
        #: A digest of every step (what ran, when): equal digests mean the same run.
        self.trace = hashlib.sha256()

    # -- wiring -----------------------------------------------------------------------

    def new_link(self, name: str) -> Link:
        link = Link(self.scheduler, name, self.config.latency)
        self.links.append(link)
        return link

    def accept(self, gateway_name: str, link: Link) -> None:
        gateway = self.gateways[gateway_name]
        if gateway.alive:
            gateway.accept(link)
        else:
            link.reset(f"connection refused: {gateway_name} is down")

    def pick_gateway(self) -> str:
        """Where a (re)connecting engine lands: the load balancer picks any live replica."""
        alive = [name for name, g in self.gateways.items() if g.alive]
        return self.rng.choice(alive or list(self.gateways))

    def start_gateway(self, name: str) -> SimGateway:
        gateway = SimGateway(self, name, self.processor_config)
        self.gateways[name] = gateway
        gateway.start([peer for peer in self.gateway_names if peer != name])
        return gateway

    def restart_gateway(self, name: str, old: SimGateway) -> None:
        if self.gateways.get(name) is old and not old.alive:
            self.stats["gateway_restarts"] += 1
            self.start_gateway(name)

    def build(self) -> None:
        for name in self.gateway_names:
            self.gateways[name] = SimGateway(self, name, self.processor_config)
            self.gateways[name].alive = False
        for name in self.gateway_names:
            self.start_gateway(name)
        count = self.rng.randint(*self.config.engines)
        per_tenant: Counter[str] = Counter()
        for _ in range(count):
            tenant = self.rng.choice(self.config.tenants)
            models = tuple(m for m in self.config.models if self.rng.random() < 0.6) or (self.rng.choice(self.config.models),)
            # Engine ids restart per tenant: two tenants reuse "e0", which must not mix them up.
            home = self.gateway_names[len(self.engines) % len(self.gateway_names)]
            engine = EngineNode(self, f"e{per_tenant[tenant]}", tenant, models, self.rng.randint(1, 4), home)
            per_tenant[tenant] += 1
            self.engines.append(engine)
        for engine in self.engines:
            self.scheduler.after(self.rng.uniform(0.0, 0.5), engine.start, "engine-start")

    # -- clients ------------------------------------------------------------------------

    def _arrive(self) -> None:
        if not self._arrivals:
            return
        alive = [g for g in self.gateways.values() if g.alive]
        if not alive:  # every replica is down: clients cannot connect until one is back
            self.scheduler.after(self.config.request_interval, self._arrive, "client")
            return
        gateway = self.rng.choice(alive)
        tenant = self.rng.choice(self.config.tenants)
        model = self.rng.choice(self.config.models)
        timeout = self.rng.uniform(0.3, 6.0) if self.rng.random() < 0.35 else None
        self.submit(gateway, tenant, model, self.rng.random() < 0.5, timeout)
        self.scheduler.after(self.rng.expovariate(1 / self.config.request_interval), self._arrive, "client")

    def submit(self, gateway: SimGateway, tenant: str, model: str, streaming: bool, timeout: float | None,
               probe: bool = False) -> ClientRequest:
        self._request_seq += 1
        now = self.scheduler.now
        duration = self.processor_config.max_task_duration if timeout is None else timeout
        request = ClientRequest(self.ledger, f"c{self._request_seq}", gateway.name, tenant, model, streaming,
                                now + duration, now, probe)
        chat = chat_pb2.CreateChatCompletionRequest(model=model, stream=streaming)
        self.stats["requests"] += 1
        self.checks.request_accepted(request)
        gateway.submit(request, worker_pb2.TaskRequest(chat_completion=chat), timeout)
        return request

    # -- running -----------------------------------------------------------------------

    def step(self) -> None:
        label = self.scheduler.step()
        if label is None:
            raise InvariantViolated(LIVENESS, "nothing left to run: the cluster went silent")
        self.steps += 1
        self.trace.update(f"{label}@{self.scheduler.now!r};".encode())
        self.ledger.now = self.scheduler.now
        self.checks.check(self.scheduler.now)
        if len(self.links) >= 2 * self._links_kept:
            self.links = [link for link in self.links if not link.finished]
            self._links_kept = max(64, len(self.links))

    def run_until(self, done: Callable[[], bool], limit: float) -> bool:
        while not done():
            next_time = self.scheduler.next_time()
            if next_time is None or next_time > limit:
                return done()
            self.step()
        return True

    def run(self) -> None:
        config = self.config
        self.build()
        self._arrivals = True
        self.scheduler.after(0.5, self._arrive, "client")
        self.faults.start()
        self._phase("start")
        if config.duration is None:
            for _ in range(config.steps):
                self.step()
        else:
            self.run_until(lambda: False, config.duration)
        # Heal: no more faults or new requests; what is dead comes back.
        self._phase("faults")
        self.faults.stop()
        self._arrivals = False
        for name, gateway in list(self.gateways.items()):
            if not gateway.alive:
                self.restart_gateway(name, gateway)
        for engine in self.engines:
            engine.set_ready(True)
        ledger = self.ledger
        if not self.run_until(lambda: not ledger.live, self.scheduler.now + config.heal_timeout):
            stuck = list(ledger.live.values())[:5]
            raise InvariantViolated(ENDS_ONCE, f"requests never ended after the faults stopped: {stuck}")
        self._phase("heal")
        if not self.run_until(self.converged, self.scheduler.now + config.converge_timeout):
            raise InvariantViolated(CONVERGENCE, f"t={self.scheduler.now:.4f} {config.converge_timeout:g}s after the "
                                    f"faults stopped, {self.missing_routes()}; {self.describe_engines()}")
        self._phase("converge")
        self.run_until(lambda: False, self.scheduler.now + 1.0)
        # One gateway at a time, so that no probe is rescued by traffic another one causes.
        for gateway in list(self.gateways.values()):
            probes = self.probe(gateway)
            # Nothing else is live after the heal: the probes are done when nothing is.
            self.run_until(lambda: not ledger.live, self.scheduler.now + config.probe_timeout)
            failed = [p for p in probes if not p.succeeded]
            if failed:
                details = "; ".join(f"{p.task_id} at {p.gateway} for {p.tenant}/{p.model}: {p.outcome} {p.status} "
                                    f"{p.reason!r} {p.events}" for p in failed[:4])
                raise InvariantViolated(
                    LIVENESS, f"t={self.scheduler.now:.4f} {len(failed)} of {len(probes)} requests at {gateway.name} "
                    f"failed after the faults stopped: {details}; {self.describe_engines()}")
        self._phase("probe")
        self.run_until(lambda: False, self.scheduler.now + 3.0)
        self.check_memory()
        self._phase("drain")

    def _phase(self, name: str) -> None:
        """A phase ended: count its steps and virtual time (``stats``, for the campaign's summary)."""
        steps, now = self.steps, self.scheduler.now
        self.stats[f"steps_{name}"] = steps - self._phase_start[0]
        self.stats[f"ms_{name}"] = round((now - self._phase_start[1]) * 1000)
        self._phase_start = (steps, now)

    def converged(self) -> bool:
        """Every up engine is registered, routable, at every live gateway (locally or via a peer)."""
        return self.checks.converged()

    def missing_routes(self) -> list[str]:
        """What keeps the cluster from having converged: engines a gateway does not route to,
        peer streams not open."""
        missing = []
        for engine in self.engines:
            if not engine.up or engine.current is None:
                continue
            for gateway in self.gateways.values():
                if not gateway.alive:
                    continue
                view = gateway.processor.engine(engine.tenant, engine.name_at(gateway.name))
                if view is None or not view.routable:
                    missing.append(f"{gateway.name} cannot route to {engine.name}")
        for gateway in self.gateways.values():
            if gateway.alive:
                missing += [f"{gateway.name} has no stream to {d.peer}" for d in gateway.dials.values() if not d.open]
        return missing

    def probe(self, gateway: SimGateway) -> list[ClientRequest]:
        """Ask ``gateway`` for every model an up engine of each tenant serves, streaming and not."""
        probes = []
        for tenant in self.config.tenants:
            served = sorted({m for e in self.engines if e.up and e.tenant == tenant for m in e.models})
            for model in served:
                for streaming in (False, True):
                    probes.append(self.submit(gateway, tenant, model, streaming, None, probe=True))
        self.stats["probes"] += len(probes)
        return probes

    def describe_engines(self) -> str:
        """Where each engine is attached and what each gateway knows of it."""
        parts = []
        for engine in self.engines:
            attached = engine.gateway_of.get(engine.current) if engine.current is not None else None
            views = []
            for gateway in self.gateways.values():
                view = gateway.processor.engine(engine.tenant, engine.name_at(gateway.name)) if gateway.alive else None
                views.append(f"{gateway.name}:" + ("-" if view is None else
                             f"{view.locality.value}{'' if view.routable else '(not routable)'}"))
            parts.append(f"{engine.name}@{attached} {engine.core.state.value} [{' '.join(views)}]")
        return "engines: " + ", ".join(parts)

    # -- invariants --------------------------------------------------------------------

    def check_memory(self) -> None:
        """At the end: no live task, buffer or queue anywhere."""
        ledger = self.ledger
        for gateway in self.gateways.values():
            if not gateway.alive:
                continue
            ledger.checks += 1
            status = gateway.processor.status()
            if status["tasks"] or status["waiting"] or status["retry_pending"] or gateway.live_tasks():
                held = sorted({t for tenant in status["tenants"].values() for e in tenant["engines"].values()
                               for t in e["tasks"]})
                ledger.fail(MEMORY, f"{gateway.name} still holds tasks {held}{self._orphans(held)}: {status}")
            if gateway.processor.in_flight_counts() or gateway.forwarded_in_flight() or gateway.clients:
                ledger.fail(MEMORY, f"{gateway.name} still has tasks in flight")
            for (end, stream_id) in gateway.calls:
                if not end.closed and end.conn.buffered_amount(stream_id):
                    ledger.fail(MEMORY, f"{gateway.name}: stream {stream_id} still buffers bytes")
        for engine in self.engines:
            ledger.checks += 1
            if engine.core.in_progress or engine.runtime.live:
                held = sorted(engine.runtime.live)
                ledger.fail(MEMORY, f"engine {engine.name} still holds {engine.core.in_progress} tasks, running "
                                    f"{held}{self._orphans(held)}")
            for end, stream_id in engine.streams.values():
                if end.conn.buffered_amount(stream_id):
                    ledger.fail(MEMORY, f"engine {engine.name}: stream {stream_id} still buffers bytes")

    def _orphans(self, task_ids: list[str]) -> str:
        """Names the tasks whose client request has ended: attempts nobody waits for."""
        ledger = self.ledger
        ended = [t for t in task_ids if ledger.request_id(t) in ledger.requests and ledger.request_id(t) not in ledger.live]
        return f" (orphaned attempts of ended requests: {ended})" if ended else ""


def run_seed(seed: int, config: SimConfig = SimConfig()) -> SimResult:
    """Run one seed; the result carries the first violated invariant, if any."""
    started = time.perf_counter()
    cluster = Cluster(seed, config)
    violation: InvariantViolated | None = None
    try:
        cluster.run()
    except InvariantViolated as exc:
        violation = exc
    except Exception as exc:  # noqa: BLE001 - any exception out of the cluster is a finding
        where = traceback.extract_tb(exc.__traceback__)[-1]
        violation = InvariantViolated(
            NO_CRASH, f"t={cluster.scheduler.now:.4f} {type(exc).__name__}: {exc} "
            f"(at {where.filename}:{where.lineno} in {where.name})")
        violation.__cause__ = exc
    stats = Counter(cluster.stats)
    stats["steps"] = cluster.steps
    stats["invariant_checks"] = cluster.ledger.checks
    stats["requests_completed"] = sum(1 for r in cluster.ledger.requests.values() if r.outcome == "completed")
    stats["requests_failed"] = sum(1 for r in cluster.ledger.requests.values() if r.outcome == "failed")
    stats["deadlines_expired"] = sum(1 for r in cluster.ledger.requests.values() if r.status == 504)
    return SimResult(seed, config.steps, violation, config.options(), stats, Counter(cluster.faults.injected),
                     cluster.scheduler.now, time.perf_counter() - started, cluster.trace.hexdigest()[:16])
