"""``tools/sim --report``: the exchange at 3, 10, 25 and 50 gateways, 10 engines per gateway.

Rules this file keeps: the same cluster as the campaign (production gateway
core, real gRPC machines, simulated links, per-step invariants), one seed per
size, no faults but one gateway restart, and the same load *per engine* at
every size, so that a figure that grows with the gateway count is the
exchange's own cost. Everything is virtual time; the table is deterministic.

The shape: gateway ``g``'s ten engines serve model ``m{g mod 3}`` (one
tenant), so two requests in three land at a gateway without a local engine
of their model and cross the exchange. Each engine gets a non-streaming
request every ``1 / PER_ENGINE_RATE`` seconds on average (at a random
gateway); every request changes its engine's in-progress count twice, which
is the per-engine change rate the status traffic answers.

Phases per size: *start* (until every gateway routes to every engine),
*load* (``WINDOW_REQUESTS`` requests, at least ``MIN_WINDOW`` seconds: status messages and bytes each gateway sends,
latency of exchanged requests), *cold start* (requests for a model no engine
serves are held at one gateway; an engine for it starts at another gateway
``COLD_START`` seconds later; their latency from the engine's start), and
*restart* (one gateway dies and comes back 0.05 s later; the time until every
live gateway's view of every up engine is back to the truth: routable, local
exactly where the engine is attached, every peer stream open).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness.sim.cluster import Cluster, SimConfig
from harness.sim.engine import EngineNode
from harness.sim.gateway import STATUS_INTERVAL
from harness.sim.invariants import ClientRequest
from protocol.processor.keys import Locality

SIZES = (3, 10, 25, 50)
ENGINES_PER_GATEWAY = 10
MODELS = 3
#: Requests per engine per virtual second (each changes the engine's load twice).
PER_ENGINE_RATE = 0.1
#: The load phase lasts long enough for this many requests, and at least ``MIN_WINDOW`` seconds.
WINDOW_REQUESTS = 300
MIN_WINDOW = 5.0
COLD_START = 1.0
COLD_REQUESTS = 8
SEED = 1
#: How often (virtual seconds) the restart phase compares every view with the truth.
VIEW_CHECK = 0.02
CONFIG = SimConfig(engines=(0, 0), tenants=("t1",), models=tuple(f"m{i}" for i in range(MODELS)),
                   runtime_delay=(0.005, 0.005))


@dataclass
class SizeReport:
    gateways: int
    engines: int
    status_messages: float  # per gateway per virtual second
    status_bytes: float
    exchange_ms: tuple[float, float]  # p50, p99
    exchanged: int
    cold_start_ms: tuple[float, float]
    restart_intervals: float | None  # None: not converged within the limit
    cpu: float  # seconds of this process's CPU the size took (the machine may be shared)
    steps: int


def _percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    if not ordered:
        return (float("nan"), float("nan"))
    return (ordered[(len(ordered) - 1) // 2], ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))])


class ScaleRun:
    """One size: the cluster, its load, and what the report measures."""

    def __init__(self, gateways: int, seed: int = SEED, window_requests: int = WINDOW_REQUESTS) -> None:
        self.cluster = Cluster(seed, dataclasses.replace(CONFIG, gateways=gateways))
        self.window_requests = window_requests
        self.load_on = False
        self.exchange: list[ClientRequest] = []

    def build(self) -> None:
        cluster = self.cluster
        cluster.build()  # gateways only: CONFIG has no engines
        names = cluster.gateway_names
        for index in range(ENGINES_PER_GATEWAY * len(names)):
            home = names[index % len(names)]
            model = f"m{(index % len(names)) % MODELS}"
            engine = EngineNode(cluster, f"e{index}", "t1", (model,), 4, home)
            cluster.engines.append(engine)
            cluster.scheduler.after(cluster.rng.uniform(0.0, 0.5), engine.start, "engine-start")

    def run(self) -> SizeReport:
        started = time.process_time()
        cluster = self.cluster
        scheduler = cluster.scheduler
        self.build()
        self._until(cluster.converged, 60.0, "start")
        self.load_on = True
        scheduler.after(0.0, self._arrive, "client")
        self._settle(1.0)  # the load reaches its steady state
        before = (cluster.stats["status_sent"], cluster.stats["status_bytes"])
        self.exchange.clear()
        window = max(MIN_WINDOW, self.window_requests / self.rate)
        self._settle(window)
        sent = cluster.stats["status_sent"] - before[0]
        sent_bytes = cluster.stats["status_bytes"] - before[1]
        per_gateway = len(cluster.gateway_names) * window
        exchanged = list(self.exchange)
        cold = self._cold_start()  # long enough for the window's last requests to end, too
        restart = self._restart()
        self.load_on = False
        latencies = [(r.first_result_at - r.submitted_at) * 1000 for r in exchanged
                     if r.succeeded and r.first_result_at is not None]
        if len(latencies) != len(exchanged):
            raise RuntimeError(f"{len(exchanged) - len(latencies)} of {len(exchanged)} exchanged requests failed")
        return SizeReport(
            len(cluster.gateway_names), len(cluster.engines) - 1, sent / per_gateway, sent_bytes / per_gateway,
            _percentiles(latencies), len(exchanged), cold, restart, time.process_time() - started, cluster.steps)

    # -- load -----------------------------------------------------------------------------

    def _arrive(self) -> None:
        if not self.load_on:
            return
        cluster = self.cluster
        rng = cluster.rng
        names = cluster.gateway_names
        gateway = cluster.gateways[rng.choice(names)]
        model = f"m{rng.randrange(MODELS)}"
        if gateway.alive:
            request = cluster.submit(gateway, "t1", model, False, None)
            if int(gateway.name[2:]) % MODELS != int(model[1:]):  # no local engine serves it
                self.exchange.append(request)
        cluster.scheduler.after(rng.expovariate(self.rate), self._arrive, "client")

    @property
    def rate(self) -> float:
        """Client requests per virtual second, over the whole cluster."""
        return PER_ENGINE_RATE * ENGINES_PER_GATEWAY * len(self.cluster.gateway_names)

    # -- phases ---------------------------------------------------------------------------

    def _cold_start(self) -> tuple[float, float]:
        """Requests held for a model nobody serves; an engine for it starts elsewhere later."""
        cluster = self.cluster
        names = cluster.gateway_names
        holder, starter = cluster.gateways[names[0]], names[-1]
        held = [cluster.submit(holder, "t1", "cold", False, None) for _ in range(COLD_REQUESTS)]
        engine = EngineNode(cluster, "cold", "t1", ("cold",), COLD_REQUESTS, starter)
        cluster.engines.append(engine)
        up_at = cluster.scheduler.now + COLD_START
        cluster.scheduler.at(up_at, engine.start, "engine-start")
        self._until(lambda: all(not r.live for r in held), COLD_START + 30.0, "cold start")
        latencies = [(r.first_result_at - up_at) * 1000 for r in held if r.succeeded and r.first_result_at is not None]
        if len(latencies) != len(held):
            raise RuntimeError(f"{len(held) - len(latencies)} of {len(held)} requests held for a cold start failed")
        return _percentiles(latencies)

    def _restart(self) -> float | None:
        """One gateway dies and restarts: status intervals until every view is the truth again."""
        cluster = self.cluster
        victim = cluster.gateways[cluster.gateway_names[1 % len(cluster.gateway_names)]]
        victim.die()
        died_at = cluster.scheduler.now
        cluster.scheduler.after(0.05, lambda: cluster.restart_gateway(victim.name, victim), "gw-restart")
        limit = 20 * STATUS_INTERVAL
        back: list[float] = []

        def look() -> None:
            if self._views_true():
                back.append(cluster.scheduler.now)
            elif cluster.scheduler.now - died_at < limit:
                cluster.scheduler.after(VIEW_CHECK, look, "view-check")

        cluster.scheduler.after(0.06, look, "view-check")
        cluster.run_until(lambda: bool(back), died_at + limit + 1.0)
        return (back[0] - died_at) / STATUS_INTERVAL if back else None

    def _views_true(self) -> bool:
        cluster = self.cluster
        live = [g for g in cluster.gateways.values() if g.alive]
        if len(live) < len(cluster.gateway_names):
            return False
        for gateway in live:
            if any(not dial.open for dial in gateway.dials.values()):
                return False
        for engine in cluster.engines:
            if not engine.up or engine.current is None or engine.current.closed:
                return False  # no engine stops in this phase: one not attached is reconnecting
            attached = engine.gateway_of.get(engine.current)
            for gateway in live:
                view = gateway.processor.engine(engine.tenant, engine.name_at(gateway.name))
                if view is None or not view.routable:
                    return False
                if (view.locality is Locality.LOCAL) != (gateway.name == attached):
                    return False
        return True

    def _settle(self, seconds: float) -> None:
        self.cluster.run_until(lambda: False, self.cluster.scheduler.now + seconds)

    def _until(self, done: Callable[[], bool], limit: float, phase: str) -> None:
        if not self.cluster.run_until(done, self.cluster.scheduler.now + limit):
            raise RuntimeError(f"{len(self.cluster.gateway_names)} gateways: {phase} did not finish in {limit:g}s")


def report(sizes: tuple[int, ...] = SIZES, out: Callable[[str], None] = print,
           window_requests: int = WINDOW_REQUESTS) -> list[SizeReport]:
    """Run every size and print the table (Markdown) as the rows come."""
    out(f"tools/sim --report: {ENGINES_PER_GATEWAY} engines per gateway, {PER_ENGINE_RATE:g} requests per engine "
        f"per second, status interval {STATUS_INTERVAL:g} s, seed {SEED}; virtual time")
    out("")
    out("| gateways | engines | status msgs/s per gateway | status bytes/s per gateway | exchange p50 / p99 ms "
        "| cold start p50 / p99 ms | converged after a restart | CPU s |")
    out("|---|---|---|---|---|---|---|---|")
    rows = []
    for size in sizes:
        row = ScaleRun(size, window_requests=window_requests).run()
        rows.append(row)
        restart = "not within 20 intervals" if row.restart_intervals is None else \
            f"{row.restart_intervals:.2f} intervals"
        out(f"| {row.gateways} | {row.engines} | {row.status_messages:,.1f} | {row.status_bytes:,.0f} | "
            f"{row.exchange_ms[0]:.1f} / {row.exchange_ms[1]:.1f} | {row.cold_start_ms[0]:.1f} / "
            f"{row.cold_start_ms[1]:.1f} | {restart} | {row.cpu:.1f} |")
    return rows


def main() -> int:
    report()
    return 0
