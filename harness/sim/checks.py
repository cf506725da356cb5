"""The invariants checked after every step, kept incrementally (or recomputed in full).

Rules this file keeps: one definition per invariant, written once as the
*full* check (every live request, gateway, forwarded task and engine); the
incremental check looks only at what can have changed since the last step
(an index per invariant: deadlines in a heap, the gateways and engines the
step touched), and when it sees a violation it runs the full check, so both
modes report the same violation with the same words. ``SimConfig.full_checks``
(``tools/sim --full-checks``) runs the full check after every step instead:
tests/sim/test_sim.py runs seeds both ways and compares.

What each invariant needs:

- a client request outlives its deadline by a tick (``DEADLINE``): a heap of
  (deadline, request), popped once due; a request that ended is dropped.
- a forwarded task outlives its deadline by a tick: a heap of the entries the
  gateways' dials track, valid while the dial still tracks that deadline.
- a gateway's processor holds as many live tasks as its clients and peers
  await (``MEMORY``): only the gateways the step gave an input to, against
  the core's running count of forwarded tasks (the full check sums every
  dialled peer's).
- an engine's core and runtime agree on the tasks running (``MEMORY``): only
  the engines the step gave an input to.
- *converged* (every live gateway routes to every up engine, every dial open):
  a boolean over E x G + G x G conditions; the incremental form keeps the
  first condition it found unmet and re-checks that one first, so a step costs
  O(1) until it is met, then scans on from there.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import TYPE_CHECKING

from harness.sim.invariants import DEADLINE, MEMORY, TICK, ClientRequest

if TYPE_CHECKING:
    from harness.sim.cluster import Cluster
    from harness.sim.engine import EngineNode
    from harness.sim.gateway import SimGateway, SimDialledPeerStream


class StepChecks:
    """The per-step invariants of one cluster; see the module docstring."""

    def __init__(self, cluster: Cluster, full: bool) -> None:
        self.cluster = cluster
        self.full = full
        self._seq = count()
        self._requests: list[tuple[float, int, ClientRequest]] = []
        self._forwarded: list[tuple[float, int, SimGateway, SimDialledPeerStream, str]] = []
        # Touched since the last check (dicts: insertion order, so reports are deterministic).
        self._gateways: dict[SimGateway, None] = {}
        self._engines: dict[EngineNode, None] = {}
        self._unmet = 0

    # -- what the harness tells the index -----------------------------------------------

    def request_accepted(self, request: ClientRequest) -> None:
        heapq.heappush(self._requests, (request.deadline, next(self._seq), request))

    def forwarded_deadline(self, gateway: SimGateway, dial: SimDialledPeerStream, task_id: str, deadline: float) -> None:
        heapq.heappush(self._forwarded, (deadline, next(self._seq), gateway, dial, task_id))

    def gateway_touched(self, gateway: SimGateway) -> None:
        self._gateways[gateway] = None

    def engine_touched(self, engine: EngineNode) -> None:
        self._engines[engine] = None

    # -- after every step ------------------------------------------------------------------

    def check(self, now: float) -> None:
        if self.full:
            self._gateways.clear()
            self._engines.clear()
            self.check_all(now)
            return
        if self._incremental_violation(now):
            self.check_all(now)
            raise AssertionError(f"t={now:.4f}: the incremental checks saw a violation the full checks did not")

    def _incremental_violation(self, now: float) -> bool:
        ledger = self.cluster.ledger
        requests = self._requests
        while requests and requests[0][0] + TICK < now:
            ledger.checks += 1
            if heapq.heappop(requests)[2].live:
                return True
        forwarded = self._forwarded
        while forwarded and forwarded[0][0] + TICK < now:
            deadline, _, gateway, dial, task_id = heapq.heappop(forwarded)
            ledger.checks += 1
            if gateway.alive and dial.deadlines.get(task_id) == deadline:
                return True
        gateways, self._gateways = self._gateways, {}
        for gateway in gateways:
            if gateway.alive:
                ledger.checks += 1
                # The core's running count of forwarded tasks, not a sum over every dialled peer
                # (check_all sums them, so a count that drifted fails loudly there).
                if gateway.live_tasks() != len(gateway.clients) + gateway.core.forwarded_in_flight:
                    return True
        engines, self._engines = self._engines, {}
        for engine in engines:
            if not engine.crashed:
                ledger.checks += 1
                if not self._engine_agrees(engine):
                    return True
        return False

    def check_all(self, now: float) -> None:
        """Every per-step invariant over everything (the definition; raises the first violation)."""
        cluster = self.cluster
        ledger = cluster.ledger
        for request in ledger.live.values():
            ledger.checks += 1
            if now > request.deadline + TICK:
                ledger.fail(DEADLINE, f"{request.task_id} at {request.gateway} still in flight at {now:.4f}, "
                                      f"deadline {request.deadline:.4f}; {request.events}")
        for gateway in cluster.gateways.values():
            if not gateway.alive:
                continue
            ledger.checks += 1
            if not self._gateway_balanced(gateway):
                live = gateway.live_tasks()
                expected = len(gateway.clients) + gateway.forwarded_in_flight()
                ledger.fail(MEMORY, f"{gateway.name}: processor holds {live} tasks, its clients and peers {expected}")
            for dial in gateway.dials.values():
                for task_id, deadline in dial.deadlines.items():
                    if now > deadline + TICK:
                        ledger.fail(DEADLINE, f"forwarded task {task_id} at {gateway.name} from {dial.peer} "
                                              f"still in flight at {now:.4f}, deadline {deadline:.4f}")
        for engine in cluster.engines:
            if engine.crashed:
                continue
            ledger.checks += 1
            if not self._engine_agrees(engine):
                ledger.fail(MEMORY, f"engine {engine.name}: core runs {engine.core.running} tasks, "
                                    f"runtime {len(engine.runtime.live)}")

    @staticmethod
    def _gateway_balanced(gateway: SimGateway) -> bool:
        return gateway.live_tasks() == len(gateway.clients) + gateway.forwarded_in_flight()

    @staticmethod
    def _engine_agrees(engine: EngineNode) -> bool:
        return engine.core.running == len(engine.runtime.live)

    # -- convergence -------------------------------------------------------------------

    def converged(self) -> bool:
        """Every up engine routable at every live gateway, every live gateway's dials open."""
        total = self._conditions()
        if self.full:
            return not any(self._unmet_condition(i) for i in range(total))
        start = self._unmet if self._unmet < total else 0
        for offset in range(total):
            index = (start + offset) % total
            if self._unmet_condition(index):
                self._unmet = index
                return False
        return True

    def _conditions(self) -> int:
        engines, gateways = len(self.cluster.engines), len(self.cluster.gateways)
        return engines * gateways + gateways * gateways

    def _unmet_condition(self, index: int) -> bool:
        cluster = self.cluster
        names = cluster.gateway_names
        width = len(names)
        pairs = len(cluster.engines) * width
        if index < pairs:
            engine = cluster.engines[index // width]
            gateway = cluster.gateways[names[index % width]]
            if not engine.up or engine.current is None or not gateway.alive:
                return False
            view = gateway.processor.engine(engine.tenant, engine.name_at(gateway.name))
            return view is None or not view.routable
        index -= pairs
        gateway = cluster.gateways[names[index // width]]
        dial = gateway.dials.get(names[index % width])
        return gateway.alive and dial is not None and not dial.open

