"""Fault injection: each fault at a random point of the run, drawn from the simulation's RNG.

Rules this file keeps: faults only use what the outside world could do to
the cluster (cut, stall or reset a connection, kill or restart a process,
make a client hang up, ask a gateway to go away, an engine's readiness
flipping, a peer's reports arriving late or twice, a runtime stalling or
failing); they never reach into a machine's state. ``active`` is False once
the fault phase is over, and then nothing here fires.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from harness.sim.link import LinkState

if TYPE_CHECKING:
    from harness.sim.cluster import Cluster
    from harness.sim.gateway import SimDialledPeerStream

KINDS = (
    "engine_disconnect",
    "engine_half_open",
    "engine_restart",
    "engine_crash",
    "engine_flip_ready",
    "gateway_die",
    "gateway_restart",
    "gateway_go_away",
    "link_reset",
    "client_disconnect",
)


class Faults:
    """Draws and applies faults while ``active``; ``injected`` counts them by kind."""

    def __init__(self, cluster: Cluster, mean_interval: float) -> None:
        self.cluster = cluster
        self.mean_interval = mean_interval
        self.active = False
        self.injected: Counter[str] = Counter()

    def start(self) -> None:
        self.active = True
        self._schedule()

    def stop(self) -> None:
        self.active = False

    def _schedule(self) -> None:
        cluster = self.cluster
        cluster.scheduler.after(cluster.rng.expovariate(1 / self.mean_interval), self._fire, "fault")

    def _fire(self) -> None:
        if not self.active:
            return
        kind = self.cluster.rng.choice(KINDS)
        applied = getattr(self, kind)()
        if applied:
            self.injected[applied] += 1
        self._schedule()

    def status_fault(self, dial: SimDialledPeerStream) -> str | None:
        """Whether this status report is held back (late) or written twice."""
        if not self.active:
            return None
        roll = self.cluster.rng.random()
        if roll < 0.08:
            self.injected["status_late"] += 1
            return "late"
        if roll < 0.16:
            self.injected["status_duplicate"] += 1
            return "duplicate"
        return None

    # -- the faults: each returns the label it is counted under, or None if it did not apply --

    def engine_disconnect(self) -> str | None:
        engines = [e for e in self.cluster.engines if e.current is not None and not e.current.closed]
        if not engines:
            return None
        engine = self.cluster.rng.choice(engines)
        assert engine.current is not None
        runs = list(engine.runtime.live.values())
        if any(run.emitted for run in runs):
            label = "engine_disconnect_mid_stream"
        elif runs:
            label = "engine_disconnect_before_first_result"
        else:
            label = "engine_disconnect_idle"
        engine.current.link.reset(f"engine {engine.name} disconnected")
        return label

    def engine_half_open(self) -> str | None:
        engines = [e for e in self.cluster.engines if e.current is not None and e.current.link.state is LinkState.OPEN]
        if not engines:
            return None
        engine = self.cluster.rng.choice(engines)
        assert engine.current is not None
        engine.current.link.black_hole()
        return "engine_half_open"

    def engine_restart(self) -> str | None:
        engines = [e for e in self.cluster.engines if e.up and not e.restart_pending]
        if not engines:
            return None
        engine = self.cluster.rng.choice(engines)
        engine.restart_pending = True
        engine.shutdown(self.cluster.rng.uniform(0.0, 2.0))
        return "engine_restart"

    def engine_crash(self) -> str | None:
        engines = [e for e in self.cluster.engines if not e.crashed and not e.restart_pending]
        if not engines:
            return None
        engine = self.cluster.rng.choice(engines)
        engine.crash()
        self.cluster.scheduler.after(self.cluster.rng.uniform(0.2, 3.0), engine.restart, "engine-restart")
        return "engine_crash"

    def engine_flip_ready(self) -> str | None:
        engines = [e for e in self.cluster.engines if e.ready_override]
        if not engines:
            return None
        engine = self.cluster.rng.choice(engines)
        engine.set_ready(False)
        self.cluster.scheduler.after(self.cluster.rng.uniform(0.3, 5.0), lambda: engine.set_ready(True), "ready")
        return "engine_flip_ready"

    def gateway_die(self) -> str | None:
        alive = [g for g in self.cluster.gateways.values() if g.alive]
        if len(alive) < 2:
            return None
        gateway = self.cluster.rng.choice(alive)
        gateway.die()
        if self.cluster.rng.random() < 0.6:
            self.cluster.scheduler.after(self.cluster.rng.uniform(1.0, 6.0),
                                         lambda: self.cluster.restart_gateway(gateway.name, gateway), "gw-restart")
        return "gateway_die"

    def gateway_restart(self) -> str | None:
        alive = [g for g in self.cluster.gateways.values() if g.alive]
        if not alive:
            return None
        gateway = self.cluster.rng.choice(alive)
        gateway.die()
        self.cluster.scheduler.after(0.05, lambda: self.cluster.restart_gateway(gateway.name, gateway), "gw-restart")
        return "gateway_restart"

    def gateway_go_away(self) -> str | None:
        alive = [g for g in self.cluster.gateways.values() if g.alive]
        if not alive:
            return None
        gateway = self.cluster.rng.choice(alive)
        gateway.run(gateway.core.go_away)
        gateway.flush()
        return "gateway_go_away"

    def link_reset(self) -> str | None:
        links = [link for link in self.cluster.links if link.in_flight and link.state is LinkState.OPEN]
        if not links:
            return None
        self.cluster.rng.choice(links).reset("link reset with bytes in flight")
        return "link_reset"

    def client_disconnect(self) -> str | None:
        live = [r for r in self.cluster.ledger.live.values() if not r.probe]
        if not live:
            return None
        request = self.cluster.rng.choice(live)
        gateway = self.cluster.gateways[request.gateway]
        label = "client_disconnect_mid_stream" if request.delivered else "client_disconnect_before_result"
        gateway.client_gone(request)
        return label
