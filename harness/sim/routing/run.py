"""One seeded run: clients -> gateways (production ``Processor``s) -> modelled runtimes.

Each engine is attached to one gateway (its engine's gateway) and reports
its load (``runtime_load``: running and waiting requests, KV usage) to it
every ``report_interval``; the other gateways get the status as that gateway
reports it to its peers (``Processor.local_engines()``, what its dialled peer
sends: with the engine's spilled prefix tips), at the same moment. A task a
gateway routes to a peer's engine is forwarded as the exchange does it: the
engine's gateway takes it as a targeted task (as its dialled peer does) and
dispatches it, and results go back the same way. A request goes to a random
gateway (as behind a load balancer), with routing hints computed by the
gateway's own :func:`~protocol.routing.hints.hints_from_json`. The ``oracle`` routes each
request to the engine whose real cache holds most of its prompt, within the
same load bound, as a targeted task. Time is simulated; nothing sleeps.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

from harness.sim.routing.runtime import BLOCK_TOKENS, Job, RuntimeSpec, SimRuntime, chain
from harness.sim.routing.workloads import Request, make
from protocol.exchange.dialled_peer import peer_result
from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import DeliverResult, FailRequest, Locality, Processor, ProcessorConfig, SendTask
from protocol.processor.fair_share import forwarded_caller
from protocol.routing.hints import HintsConfig, hints_from_json
from protocol.routing.config import RoutingConfig, RoutingPolicy

POLICIES = ("round_robin", "least_in_progress", "affinity", "oracle")


@dataclass
class Result:
    workload: str
    policy: str
    gateways: int
    seed: int
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    ttft: dict[str, list[float]] = field(default_factory=dict)
    load_samples: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def ttft_mean(self, group: str | None = None) -> float:
        values = self._ttfts(group)
        return sum(values) / len(values) if values else math.nan

    def ttft_p99(self, group: str | None = None) -> float:
        values = sorted(self._ttfts(group))
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)] if values else math.nan

    def _ttfts(self, group: str | None) -> list[float]:
        return [v for g, vs in self.ttft.items() if group in (None, g) for v in vs]

    @property
    def load_imbalance(self) -> float:
        """Max over mean of the engines' time-averaged load (running + waiting requests)."""
        values = list(self.load_samples.values())
        mean = sum(values) / len(values) if values else 0
        return max(values) / mean if mean else 1.0


class Simulation:
    def __init__(self, workload: str, policy: str, gateways: int, seed: int, duration: float = 60.0,
                 warmup: float = 10.0, engines: int = 8, spec: RuntimeSpec = RuntimeSpec(),
                 scale: float = 1.0, report_interval: float = 0.25, routing: RoutingConfig = RoutingConfig(),
                 fair_queue: int = 0, fair_reserve: int = ProcessorConfig().fair_reserve) -> None:
        self.result = Result(workload, policy, gateways, seed)
        self.policy, self.duration, self.warmup, self.report_interval = policy, duration, warmup, report_interval
        self.rng = random.Random(seed * 7919 + gateways)
        self.workload = make(workload, seed, scale)
        # The index remembers about as many blocks per engine as the engine's cache holds
        # (a token is about 6 bytes of the prompt's JSON here), as an operator would set it.
        index_blocks = spec.cache_blocks * BLOCK_TOKENS * 6 // HintsConfig().block_bytes
        routing = dataclasses.replace(routing, index_blocks_per_engine=index_blocks,
                                      policy=RoutingPolicy(policy if policy != "oracle" else "least_in_progress"))
        self.bound = routing
        cap = fair_queue or None
        self.gateways = [Processor(ProcessorConfig(retry_delay=0, routing=routing, max_in_flight_per_engine=cap,
                                                   fair_reserve=fair_reserve))
                         for _ in range(gateways)]
        self.runtimes = {f"e{i}": SimRuntime(f"e{i}", spec) for i in range(engines)}
        self.result.load_samples = dict.fromkeys(self.runtimes, 0)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.requests: dict[tuple[int, str], tuple[int, Request]] = {}  # (gateway, task id) -> (client, request)
        self.jobs: dict[tuple[int, str], tuple[Job, Any]] = {}  # (gateway, wire id) -> (job, route)
        self.forwarded: dict[tuple[int, str], int] = {}  # (engine's gateway, task id) -> forwarding gateway
        self.task_ids = itertools.count()

    # --- the event loop -----------------------------------------------------

    def at(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def run(self) -> Result:
        self.report(0.0)
        for i, active in enumerate(self.workload.clients and self.workload.active):
            start = active[0] if active else 0.0
            self.at(start + self.rng.random() * 2.0, "send", i)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if now > self.duration:
                break
            getattr(self, f"on_{kind}")(now, payload)
            for g, processor in enumerate(self.gateways):
                deadline = processor.next_deadline()
                if deadline is not None and deadline <= now:
                    self.perform(now, g, processor.handle_timeout(now))
        self.result.seconds = self.duration - self.warmup
        return self.result

    def on_report(self, now: float, _: Any) -> None:
        self.report(now)

    def engine_gateway(self, name: str) -> int:
        """The gateway engine ``name`` is attached to."""
        return int(name[1:]) % len(self.gateways)

    def report(self, now: float) -> None:
        for name, runtime in self.runtimes.items():
            if now >= self.warmup:
                self.result.load_samples[name] += runtime.load()
            status = status_pb2.EngineStatus(engine_id=name, ready=True)
            model = status.models.add(id="m", is_ready=True, in_progress_task_count=runtime.load())
            model.runtime_load.CopyFrom(status_pb2.EngineStatus.RuntimeLoad(
                running_requests=len(runtime.running), waiting_requests=len(runtime.waiting),
                kv_cache_usage=runtime.kv_usage(), source="sim"))
            home = self.engine_gateway(name)
            self.perform(now, home, self.gateways[home].update_engine(("route", name), "t", status, Locality.LOCAL, now))
            relayed = next(s for _, s in self.gateways[home].local_engines() if s.engine_id == name)
            for g, processor in enumerate(self.gateways):
                if g != home:
                    self.perform(now, g, processor.update_engine(("peer", home), "t", relayed, Locality.REMOTE, now))
        self.at(now + self.report_interval, "report")

    # --- clients ------------------------------------------------------------

    def on_send(self, now: float, client_index: int) -> None:
        active = self.workload.active[client_index]
        if active is not None and not active[0] <= now < active[1]:
            return
        client = self.workload.clients[client_index]
        request = client.next()
        request.sent = now
        g = self.rng.randrange(len(self.gateways))
        task_id = f"r{next(self.task_ids)}"
        self.requests[(g, task_id)] = (client_index, request)
        task = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="m", stream=True))
        processor = self.gateways[g]
        if self.policy == "oracle":
            target = self.oracle(request)
            effects = processor.submit(now=now, task_id=task_id, tenant_id="t", request=task, origin=(g, now),
                                       target_engine_id=target)
        else:
            hints = hints_from_json("chat/completions", request.body, {})
            effects = processor.submit(now=now, task_id=task_id, tenant_id="t", request=task, origin=(g, now), hints=hints,
                                       flow=request.group)
        self.perform(now, g, effects)

    def oracle(self, request: Request) -> str:
        blocks = chain(request.prompt)
        loads = {name: r.load() for name, r in self.runtimes.items()}
        config = self.bound
        capacity = max(math.ceil(config.load_factor * (sum(loads.values()) + 1) / len(loads)), config.min_capacity)
        open_ = [name for name in self.runtimes if loads[name] < capacity]
        return max(open_, key=lambda n: (self.runtimes[n].cached_prefix_blocks(blocks), -loads[n], n))

    def finished(self, now: float, g: int, task_id: str) -> None:
        client_index, request = self.requests.pop((g, task_id))
        client = self.workload.clients[client_index]
        client.done(request)
        self.at(now + self.rng.expovariate(1 / client.think) if client.think else now, "send", client_index)

    # --- gateways' effects --------------------------------------------------

    def request_of(self, g: int, task_id: str) -> Request:
        """The client request behind task ``task_id`` of gateway ``g`` (forwarded to it or not)."""
        if (g, task_id) in self.requests:
            return self.requests[(g, task_id)][1]
        origin = self.forwarded[(g, task_id)]  # a peer's task: its id here is the peer's wire id
        owner = self.gateways[origin].attempt_owner(task_id)
        assert owner is not None
        return self.requests[(origin, owner)][1]

    def perform(self, now: float, g: int, effects: list[Any]) -> None:
        processor = self.gateways[g]
        for effect in effects:
            if isinstance(effect, SendTask) and effect.route[0] == "peer":
                # A peer's engine: the engine's gateway runs the task (as its dialled peer does).
                peer = effect.route[1]
                self.forwarded[(peer, effect.task.id)] = g
                flow, weight, criticality = forwarded_caller(effect.task.request)
                self.perform(now, peer, self.gateways[peer].submit(
                    task_id=effect.task.id, tenant_id="t", request=effect.task.request, origin=("peer", g),
                    deadline=now + effect.task.timeout_seconds, target_engine_id=effect.engine.engine_id,
                    criticality=criticality, flow=flow, weight=weight, now=now))
            elif isinstance(effect, SendTask):
                task_id = processor.attempt_owner(effect.task.id)
                if task_id is None:
                    continue  # a control task (none are configured)
                request = self.request_of(g, task_id)
                # Time to first token counts from the client's send, through any wait at a gateway.
                job = Job((g, effect.task.id), request.prompt, request.output, request.sent, request.group)
                self.jobs[job.key] = (job, effect.route)
                runtime = self.runtimes[effect.engine.engine_id]
                runtime.waiting.append(job)
                if runtime.busy_until is None:
                    self.start(now, runtime)
            elif isinstance(effect, DeliverResult | FailRequest) and effect.origin[0] == "peer":
                # A forwarded task's result goes back to the gateway that forwarded it.
                if isinstance(effect, DeliverResult):
                    processor.results_consumed(effect.task_id)
                if isinstance(effect, FailRequest) or effect.last:
                    del self.forwarded[(g, effect.task_id)]
                origin = effect.origin[1]
                self.perform(now, origin, self.gateways[origin].receive_result(("peer", g), peer_result(effect), now))
            elif isinstance(effect, DeliverResult):
                processor.results_consumed(effect.task_id)
                if effect.last:
                    self.finished(now, g, effect.task_id)
            elif isinstance(effect, FailRequest):
                self.result.failed += 1
                self.finished(now, g, effect.task_id)

    # --- runtimes -----------------------------------------------------------

    def start(self, now: float, runtime: SimRuntime) -> None:
        ends, _ = runtime.start_iteration(now)
        self.at(ends, "iteration", runtime.name)

    def on_iteration(self, now: float, name: str) -> None:
        runtime = self.runtimes[name]
        if now >= self.warmup:
            self.result.output_tokens += len(runtime.running)
        first, done = runtime.end_iteration(now)
        for job in first:
            if job.submitted >= self.warmup:
                self.result.requests += 1
                self.result.prompt_tokens += len(job.prompt)
                self.result.cached_tokens += job.cached_tokens
                self.result.ttft.setdefault(job.group, []).append(now - job.submitted)
            self.reply(now, job, worker_pb2.TaskResult(
                task_id=job.key[1], result_index=0, http_response=worker_pb2.HttpResponse(status_code=200)))
        for job in done:
            self.reply(now, job, worker_pb2.TaskResult(
                task_id=job.key[1], result_index=1,
                server_sent_event=worker_pb2.ServerSentEvent(data=b"data: {}\n\n", is_last_event=True)))
            del self.jobs[job.key]
        # A reply may have dispatched a task to this runtime (a slot freed at the gateway), which
        # started its next iteration already.
        if (runtime.running or runtime.waiting) and runtime.busy_until is None:
            self.start(now, runtime)

    def reply(self, now: float, job: Job, result: worker_pb2.TaskResult) -> None:
        g = job.key[0]
        route = self.jobs[job.key][1]
        self.perform(now, g, self.gateways[g].receive_result(route, result, now))


def simulate(workload: str, policy: str, gateways: int, seed: int, **options: Any) -> Result:
    """Run one seeded simulation and return its measurements."""
    return Simulation(workload, policy, gateways, seed, **options).run()
