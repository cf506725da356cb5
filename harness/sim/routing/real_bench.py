"""The real-runtime routing benchmark, simulated: the same clients and requests, modelled llama-servers.

:func:`simulate_run` runs a workload of :mod:`harness.real_routing.workloads`
(the very requests ``tools/bench/real_routing.py`` sends, with the same
think times and the same replica draws) through the production pure machines
of infx, on a simulated clock:

- each gateway is a :class:`~protocol.processor.core.Processor` routing by
  the policy, with the hints the gateway computes from the request's JSON and
  its ``x-session-id``;
- each engine is the agent's own :class:`~protocol.agent.core.EngineAgentCore`
  (statuses coalesced as the agent sends them) and, unless load reports are
  off, its :class:`~protocol.agent.runtime_load.RuntimeLoadMonitor` reading
  the modelled server's ``/metrics`` and ``/slots`` every second;
- each runtime is a :class:`~harness.sim.routing.llama.LlamaServerModel`.

The topology is the benchmark's: one gateway holding every engine, or three
gateways holding one each, which forward tasks for a peer's engine to that
engine's gateway (as its receiver runs them: a task targeted at the engine)
and hear of each other's engines from their reports, which the exchange
sends at once when an engine comes or changes beyond its load counts (its
readiness; a spilled tip as soon as it is recorded) and coalesces to one every quarter of the status
interval (2.5 s) otherwise. Hops cost no time.

The records are :class:`harness.real_routing.figures.Record`, so that the
real and the simulated runs give figures the same code computes.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.gguf_models import BENCH
from harness.real_routing.figures import Figures, Record, figures
from harness.real_routing.workloads import Client, Conversation, Workload
from harness.sim.routing.llama import LlamaCosts, LlamaJob, LlamaServerModel
from protocol.agent.core import EngineAgentCore
from protocol.agent.effects import AgentConfig, SendResult, SendStatus, StartTask
from protocol.agent.slot_keeper import Plan, SlotKeeper, shared_prompt, worth_saving
from protocol.agent.runtime_load import (
    LoadChanged,
    LoadConfig,
    RuntimeLoadMonitor,
    ScrapeAnswer,
    ScrapeRuntime,
)
from protocol.exchange.dialled_peer import peer_result
from protocol.exchange.status_reports import shape_of
from protocol.pb import chat_pb2, worker_pb2
from protocol.processor.core import (
    DeliverResult,
    FailRequest,
    LocalEnginesChanged,
    Locality,
    Processor,
    ProcessorConfig,
    SendTask,
)
from protocol.processor.fair_share import forwarded_caller
from protocol.routing.hints import hints_from_json
from protocol.routing.config import RoutingConfig, RoutingPolicy

__all__ = ["SimRun", "calibration_problems", "simulate_run"]

MODEL = "llm"
TENANT = "default"
#: Seconds within which a gateway's changed engine loads reach its peers (``--status-interval`` / 4).
RELAY_INTERVAL = 2.5


@dataclass
class SimRun:
    """A simulated run's records and figures."""

    records: list[Record]
    figures: Figures


@dataclass
class _Request:
    client: int
    conversation: Conversation
    turn: int
    replica: int
    sent: float
    prompt: list[int]
    #: The conversation's key for a slot keeper (its opening's hash), whether its slot is worth saving, and the
    #: key of the system prompt it shares with other conversations.
    opening: int = 0
    save: bool = False
    shares: int = 0
    first: float | None = None
    engine: str = ""
    job: LlamaJob | None = None


@dataclass
class _ClientState:
    client: Client
    rng: random.Random
    pending: list[Conversation]
    active: list[tuple[Conversation, int]] = field(default_factory=list)
    ready_at: float = 0.0


class _Simulation:
    def __init__(self, workload: Workload, policy: str, replicas: int, seed: int, *, engines: int, slots: int,
                 context_per_slot: int, costs: LlamaCosts, load_reports: bool, max_in_flight: int | None,
                 bytes_per_token: int, routing: Mapping[str, Any], home_by_session: bool,
                 processor: Mapping[str, Any], relay_interval: float, slot_files: int = 0) -> None:
        self.workload, self.seed, self.replicas = workload, seed, replicas
        self.relay_interval = relay_interval
        self.home_by_session = home_by_session
        routing_config = dataclasses.replace(RoutingConfig(policy=RoutingPolicy(policy)), **routing)
        self.gateways = [Processor(ProcessorConfig(routing=routing_config, max_in_flight_per_engine=max_in_flight,
                                                   **processor))
                         for _ in range(replicas)]
        cache_mib = workload.cache_ram(bytes_per_token)
        cache_ram = (cache_mib if cache_mib is not None else 8192) * 1024 * 1024
        # A saved context takes its KV and 12 bytes of cell metadata per token (llama_kv_cache::state_write_*).
        self.runtimes = {f"e{i}": LlamaServerModel(f"e{i}", slots=slots, context_per_slot=context_per_slot,
                                                   cache_ram=cache_ram, bytes_per_token=bytes_per_token + 12,
                                                   costs=costs)
                         for i in range(engines)}
        self.home = {name: i % replicas for i, name in enumerate(self.runtimes)}
        self.agents = {name: EngineAgentCore(AgentConfig(engine_id=name, models=(MODEL,))) for name in self.runtimes}
        #: ``--runtime-slot-files``: each agent's slot keeper (protocol.agent.slot_keeper), and the jobs waiting in it.
        self.keepers = {name: SlotKeeper(slots, slot_files, f"infx-{name}-") for name in self.runtimes} \
            if slot_files else {}
        self.kept_jobs: dict[str, LlamaJob] = {}
        self.monitors = {name: RuntimeLoadMonitor(LoadConfig()) for name in self.runtimes} if load_reports else {}
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.timers: dict[tuple[str, Any], float] = {}
        self.relay_due: dict[int, float] = {}
        #: Per gateway, its local engines' shapes (statuses but for load counts) as last relayed.
        self.relayed: dict[int, dict[str, bytes]] = {}
        #: Per gateway, its processor's count of spilled tips recorded when it last relayed for one.
        self.tips_relayed: dict[int, int] = {}
        self.requests: dict[tuple[int, str], _Request] = {}  # (gateway, task id) -> request
        self.forwarded: dict[tuple[int, str], int] = {}  # (engine's gateway, wire id) -> forwarding gateway
        self.jobs: dict[str, tuple[str, _Request]] = {}  # wire id at the engine -> (engine, request)
        self.task_ids = itertools.count()
        self.records: list[Record] = []
        self.clients = [_ClientState(c, random.Random(f"replica:{seed}:{c.name}"), list(c.conversations))
                        for c in workload.clients]
        self.now = 0.0

    # --- the loop ---------------------------------------------------------------------------------

    def at(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def run(self) -> SimRun:
        for name, agent in self.agents.items():
            self.agent_effects(name, agent.start(0.0))
            if name in self.monitors:
                self.monitor_effects(name, self.monitors[name].start(0.0))
        for i, state in enumerate(self.clients):
            state.ready_at = state.client.start
            self.wake(i)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(payload)
            if not any(state.pending or state.active for state in self.clients) and not self.requests:
                break
        wall = max((r.ended for r in self.records), default=0.0)
        names = list(self.runtimes)
        return SimRun(self.records, figures(self.records, names, self.runtimes[names[0]].slots, wall))

    def arm(self, key: tuple[str, Any], deadline: float | None) -> None:
        """Wake ``key``'s machine at ``deadline`` (one pending wake per machine and time)."""
        if deadline is None or self.timers.get(key) == deadline:
            return
        self.timers[key] = deadline
        self.at(max(deadline, self.now), "timer", (key, deadline))

    def on_timer(self, payload: tuple[tuple[str, Any], float]) -> None:
        key, deadline = payload
        if self.timers.get(key) != deadline:
            return
        del self.timers[key]
        kind, name = key
        if kind == "gateway":
            self.gateway_effects(name, self.gateways[name].handle_timeout(self.now))
        elif kind == "agent":
            self.agent_effects(name, self.agents[name].handle_timeout(self.now))
        else:
            self.monitor_effects(name, self.monitors[name].handle_timeout(self.now))

    def rearm(self) -> None:
        for g, processor in enumerate(self.gateways):
            self.arm(("gateway", g), processor.next_deadline())
        for name, agent in self.agents.items():
            self.arm(("agent", name), agent.next_deadline())
        for name, monitor in self.monitors.items():
            self.arm(("monitor", name), monitor.next_deadline())

    # --- clients ----------------------------------------------------------------------------------

    def wake(self, index: int) -> None:
        """The client's next turn goes out after its think time (a closed loop, as the real client)."""
        state = self.clients[index]
        while state.pending and len(state.active) < state.client.open:
            state.active.append((state.pending.pop(0), 0))
        if not state.active:
            return
        conversation, turn = state.active[0]
        self.at(max(self.now, state.ready_at + conversation.turns[turn].think), "send", index)

    def on_send(self, index: int) -> None:
        state = self.clients[index]
        conversation, turn = state.active.pop(0)
        replica = state.rng.randrange(self.replicas)
        body = conversation.body(turn, MODEL, self.workload.max_tokens)
        request = _Request(index, conversation, turn, replica, self.now, conversation.prompt_tokens(turn))
        task_id = f"r{next(self.task_ids)}"
        self.requests[(replica, task_id)] = request
        hints = hints_from_json("chat/completions", body, {"x-session-id": [conversation.id]})
        if hints is not None:
            request.opening, request.save, request.shares = hints.opening, worth_saving(hints), shared_prompt(hints)
        if hints is not None and self.home_by_session:
            # What-if: every conversation its own home (no system prompt shared as one).
            session = hints_from_json("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": ""}]},
                                      {"x-session-id": [conversation.id]})
            assert session is not None
            hints = dataclasses.replace(hints, home=session.home)
        task = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model=MODEL, stream=True))
        self.gateway_effects(replica, self.gateways[replica].submit(
            task_id=task_id, tenant_id=TENANT, request=task, origin=("client", replica), hints=hints,
            flow=state.client.group, now=self.now))

    def answered(self, g: int, task_id: str, failed: bool) -> None:
        request = self.requests.pop((g, task_id))
        state = self.clients[request.client]
        job = request.job
        self.records.append(Record(
            state.client.name, state.client.group, request.conversation.id, request.turn, request.replica,
            request.sent, request.first, self.now, 0 if failed else 200, "failed" if failed else "",
            request.engine, job.cache_n if job else 0, job.prompt_n if job else 0))
        state.ready_at = self.now
        if request.turn + 1 < len(request.conversation.turns):
            state.active.append((request.conversation, request.turn + 1))
        self.wake(request.client)

    # --- gateways ---------------------------------------------------------------------------------

    def request_of(self, g: int, wire_id: str) -> _Request:
        """The client request behind the task ``wire_id`` that gateway ``g`` sent (maybe for a peer)."""
        origin_task = self.gateways[g].attempt_owner(wire_id)
        if origin_task is not None and (g, origin_task) in self.requests:
            return self.requests[(g, origin_task)]
        origin = self.forwarded[(g, origin_task or wire_id)]
        owner = self.gateways[origin].attempt_owner(origin_task or wire_id)
        assert owner is not None
        return self.requests[(origin, owner)]

    def gateway_effects(self, g: int, effects: list[Any]) -> None:
        processor = self.gateways[g]
        for effect in effects:
            if isinstance(effect, SendTask) and effect.route[0] == "peer":
                peer = effect.route[1]
                self.forwarded[(peer, effect.task.id)] = g
                flow, weight, criticality = forwarded_caller(effect.task.request)
                self.gateway_effects(peer, self.gateways[peer].submit(
                    task_id=effect.task.id, tenant_id=TENANT, request=effect.task.request, origin=("peer", g),
                    deadline=self.now + effect.task.timeout_seconds, target_engine_id=effect.engine.engine_id,
                    criticality=criticality, flow=flow, weight=weight, now=self.now))
            elif isinstance(effect, SendTask):
                name = effect.route[1]
                request = self.request_of(g, effect.task.id)
                request.engine = name
                self.jobs[effect.task.id] = (name, request)
                self.agent_effects(name, self.agents[name].task_received(1, effect.task, self.now))
            elif isinstance(effect, DeliverResult | FailRequest) and effect.origin[0] == "peer":
                if isinstance(effect, DeliverResult):
                    processor.results_consumed(effect.task_id)
                if isinstance(effect, FailRequest) or effect.last:
                    self.forwarded.pop((g, effect.task_id), None)
                origin = effect.origin[1]
                self.gateway_effects(origin, self.gateways[origin].receive_result(("peer", g), peer_result(effect), self.now))
            elif isinstance(effect, DeliverResult):
                processor.results_consumed(effect.task_id)
                request = self.requests[(g, effect.task_id)]
                if request.first is None and effect.result.WhichOneof("message") == "server_sent_event" \
                        and b'"content"' in effect.result.server_sent_event.data:
                    request.first = self.now
                if effect.last:
                    self.answered(g, effect.task_id, failed=False)
            elif isinstance(effect, FailRequest):
                self.answered(g, effect.task_id, failed=True)
            elif isinstance(effect, LocalEnginesChanged):
                self.relay_changed(g)
        tips = processor.tips_recorded()
        if tips != self.tips_relayed.get(g, 0):  # a new spilled tip goes to peers at once, as the core sends it
            self.tips_relayed[g] = tips
            self.relay_changed(g)
        self.rearm()

    def relay_changed(self, g: int) -> None:
        """Gateway ``g``'s local engines changed: as its dialled peers do, it reports them at once if
        more than their load counts changed (readiness, spilled tips), else within the relay interval."""
        if self.replicas < 2:
            return
        shapes = {status.engine_id: shape_of(status) for _, status in self.gateways[g].local_engines()}
        if shapes != self.relayed.get(g):
            self.relay(g)
        elif g not in self.relay_due:
            self.relay_due[g] = self.now + self.relay_interval
            self.at(self.relay_due[g], "relay", g)

    def on_relay(self, g: int) -> None:
        self.relay_due.pop(g, None)
        self.relay(g)

    def relay(self, g: int) -> None:
        """Gateway ``g`` reports its local engines to its peers (what its receivers send)."""
        local = self.gateways[g].local_engines()
        self.relayed[g] = {status.engine_id: shape_of(status) for _, status in local}
        for tenant, status in local:
            for peer, processor in enumerate(self.gateways):
                if peer != g:
                    self.gateway_effects(peer, processor.update_engine(("peer", g), tenant, status, Locality.REMOTE,
                                                                       self.now))

    # --- engines ----------------------------------------------------------------------------------

    def agent_result(self, name: str, effect: SendResult | None) -> None:
        """An answer's part the agent passes on (None: its task is gone)."""
        if effect is not None:
            self.agent_effects(name, [effect])

    def agent_effects(self, name: str, effects: list[Any]) -> None:
        g = self.home[name]
        for effect in effects:
            if isinstance(effect, SendStatus):
                registered = any(s.engine_id == name for _, s in self.gateways[g].local_engines())
                self.gateway_effects(g, self.gateways[g].update_engine(("engine", name), TENANT, effect.status,
                                                                       Locality.LOCAL, self.now))
                if not registered and self.replicas > 1:
                    self.relay(g)  # an engine that comes is reported at once
            elif isinstance(effect, SendResult):
                self.gateway_effects(g, self.gateways[g].receive_result(("engine", name), effect.result, self.now))
            elif isinstance(effect, StartTask):
                engine, request = self.jobs[effect.task.id]
                job = LlamaJob(effect.task.id, request.prompt, self.workload.max_tokens)
                request.job = job
                keeper = self.keepers.get(name)
                if keeper is None:
                    self.submit(name, job)
                else:
                    self.kept_jobs[job.key] = job
                    plan = keeper.start(effect.task.id, request.opening, request.save, request.shares)
                    if plan is not None:
                        self.run_plans(name, [plan])
        self.rearm()

    def submit(self, name: str, job: LlamaJob) -> None:
        runtime = self.runtimes[name]
        runtime.submit(job, self.now)
        if runtime.busy_until == self.now:
            self.at(self.now, "server", name)

    def run_plans(self, name: str, plans: list[Plan]) -> None:
        """What the slot-keeping runtime does with each plan: restore, then send the job in its slot."""
        for plan in plans:
            job = self.kept_jobs.pop(plan.task)
            if plan.restore is not None and not self.runtimes[name].restore_slot(plan.slot, plan.restore):
                self.keepers[name].restore_failed(plan.slot, plan.task)
            job.slot = plan.slot
            self.submit(name, job)

    def slot_released(self, name: str, wire_id: str) -> None:
        """The kept job's answer ended: its slot is saved, and waiting jobs take the slots that freed."""
        keeper = self.keepers[name]
        save, plans = keeper.ended(wire_id, True)
        if save is not None:
            self.runtimes[name].save_slot(save.slot, save.file)
            plans += keeper.save_ended(save.slot, True)
        self.run_plans(name, plans)

    def on_server(self, name: str) -> None:
        runtime = self.runtimes[name]
        if runtime.busy_until is None or runtime.busy_until > self.now:
            return
        first, finished = runtime.step(self.now)
        agent = self.agents[name]
        for job in first:
            wire_id = str(job.key)
            self.agent_result(name, agent.send_result(wire_id, worker_pb2.TaskResult(
                http_response=worker_pb2.HttpResponse(status_code=200))))
            self.agent_result(name, agent.send_result(wire_id, _event({"choices": [{"delta": {"content": "x"}}]})))
        for job in finished:
            wire_id = str(job.key)
            self.agent_result(name, agent.send_result(wire_id, _event(
                {"choices": [{"finish_reason": "length"}], "timings": {"cache_n": job.cache_n,
                                                                       "prompt_n": job.prompt_n}})))
            self.agent_result(name, agent.send_result(wire_id, worker_pb2.TaskResult(
                server_sent_event=worker_pb2.ServerSentEvent(data=b"", is_last_event=True))))
            self.agent_effects(name, agent.finish_task(wire_id, self.now))
            self.jobs.pop(wire_id, None)
            if name in self.keepers:
                self.slot_released(name, wire_id)
        if runtime.busy_until is not None:
            self.at(runtime.busy_until, "server", name)

    def monitor_effects(self, name: str, effects: list[Any]) -> None:
        monitor = self.monitors[name]
        runtime = self.runtimes[name]
        for effect in effects:
            if isinstance(effect, ScrapeRuntime):
                answers = {}
                for path in effect.paths:
                    if path == "/metrics":
                        answers[path] = ScrapeAnswer(200, runtime.metrics().encode())
                    elif path == "/slots":
                        answers[path] = ScrapeAnswer(200, json.dumps(runtime.slots_body()).encode())
                    else:
                        answers[path] = ScrapeAnswer(200, json.dumps({"total_slots": runtime.slots}).encode())
                sample = self.agents[name].load_sample()
                self.monitor_effects(name, monitor.scrape_done(effect.scrape_id, answers, sample, self.now))
            elif isinstance(effect, LoadChanged):
                self.agent_effects(name, self.agents[name].runtime_load_changed(effect.load, self.now))
        self.rearm()


def _event(payload: dict[str, Any]) -> worker_pb2.TaskResult:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    return worker_pb2.TaskResult(server_sent_event=worker_pb2.ServerSentEvent(data=data))


def simulate_run(workload: Workload, policy: str, replicas: int = 1, seed: int = 1, *, engines: int = 3,
                 slots: int = 2, context_per_slot: int = 4096, costs: LlamaCosts = LlamaCosts(),
                 load_reports: bool = True, max_in_flight: int | None = None,
                 bytes_per_token: int = BENCH.kv_bytes_per_token, routing: Mapping[str, Any] = {},
                 home_by_session: bool = False, processor: Mapping[str, Any] = {},
                 relay_interval: float = RELAY_INTERVAL, slot_files: int = 0,
                 progress: Callable[[str], None] = lambda _: None) -> SimRun:
    """Simulate one run of ``workload`` routed by infx's ``policy`` (``affinity``, ``least_in_progress``,
    ``round_robin``) with ``replicas`` gateways, as ``tools/bench/real_routing.py`` runs it for real;
    ``load_reports`` off is ``--runtime-load-interval 0``, ``max_in_flight`` is
    ``--max-in-flight-per-engine``, ``routing`` other :class:`RoutingConfig` fields (``min_capacity=2``:
    ``--routing-min-capacity 2``), ``processor`` other :class:`ProcessorConfig` fields. ``home_by_session`` is a
    what-if no option gives: each conversation's home key is its session, never a shared system prompt.
    ``relay_interval``: seconds within which a gateway's changed engines reach its peers (``--status-interval`` / 4);
    ``slot_files``: the agents keep the runtimes' slots in that many files each (``--runtime-slot-files``)."""
    progress(f"simulating {policy} x{replicas} {workload.name} seed {seed}")
    return _Simulation(workload, policy, replicas, seed, engines=engines, slots=slots,
                       context_per_slot=context_per_slot, costs=costs, load_reports=load_reports,
                       max_in_flight=max_in_flight, bytes_per_token=bytes_per_token, routing=routing,
                       home_by_session=home_by_session, processor=processor, relay_interval=relay_interval,
                       slot_files=slot_files).run()


Key = tuple[str, int, str]


def calibration_problems(real: dict[Key, float], simulated: dict[Key, float], tolerance: float = 0.03) -> list[str]:
    """Where the simulation misses the real runs: a (workload, replicas, policy) whose simulated cached share is
    more than ``tolerance`` from the real one, and two policies of one (workload, replicas) whose real shares
    differ by more than ``tolerance`` that the simulation ranks the other way (closer ones are ties)."""
    problems = []
    for key in sorted(real):
        if abs(simulated[key] - real[key]) > tolerance:
            problems.append(f"{key}: simulated {simulated[key]:.1%}, real {real[key]:.1%}")
    for a in sorted(real):
        for b in sorted(real):
            if a[:2] == b[:2] and real[a] - real[b] > tolerance and simulated[a] <= simulated[b]:
                problems.append(f"{a[:2]}: {a[2]} reuses more than {b[2]} for real ({real[a]:.1%} > {real[b]:.1%}) "
                                f"but not simulated ({simulated[a]:.1%} <= {simulated[b]:.1%})")
    return problems
