"""What every routing policy reads: the routable engines of each (tenant, model), their loads,
loaded adapters and spilled prompts; pure, no I/O, no clock.

Rules this file keeps: it changes only when the processor tells the router something (an
engine's status, readiness and models; a task sent to or leaving an engine), never when a
policy chooses, so the same inputs give the same pools in every process. Policies read it;
what a policy remembers of its own (a ring, a turn, a prefix index) is the policy's.

Load of an engine: the larger of this processor's tasks in flight on it and
what the engine last reported plus the tasks this processor sent it since,
less those that left it since.
The report is its runtime's running plus waiting requests
(``EngineStatus.Model.runtime_load``), else its ``in_progress_task_count``,
summed over its models; it counts every gateway's tasks, so with several
gateways each sees about the same load and makes about the same choice.

"Since" is since the runtime was read, not since the report arrived, where
the report says (``runtime_load.tasks_received`` / ``tasks_ended``: the
agent's count of the tasks its stream brought and of those that ended, when
its scrape went out). A report arrives a scrape's and a hop's time after the
reading: the tasks sent in between are not in it, and those that ended in
between are in it although they left (counting them again filled a
conversation's home to its bound and moved its next turn off its cache).
Only the engine's own gateway sends on that stream, so only it can subtract:
for a local engine, the tasks sent since the reading are those this processor
sent beyond ``tasks_received``, less those that left beyond ``tasks_ended``.
A peer's engine, an unstamped report, or counts that cannot be this stream's
(more received than sent: the engine came back on another stream while its
old one still had tasks) keep the rule above.

One runtime, one member: engines that name the runtime they front
(``EngineStatus.infx_runtime_name``: a runtime served by URL, which each
worker and each gateway replica that finds it serves with an engine of its
own) are routed to as one. Of a runtime's engines, the pools hold one: this
gateway's own, else the peer's with the least engine id that takes tasks;
the others are kept and counted but sit out, so a request is never forwarded
to a peer for a runtime this gateway reaches itself, and no runtime is counted
twice in a pool's total or its engines. The load of this gateway's own engine
of such a runtime is its tasks in flight there plus the tasks each peer's
engine of it reports: every task the runtime has from the gateways, the
peers' as of their last reports (which follow each answer at once), where the
runtime's own reading, which every gateway takes apart, counts the others'
tasks that ended since it was taken and misses those sent since.

Capacity: ``EngineStatus.infx_runtime_slots`` (the requests its runtime runs
at once, llama.cpp's slots or vLLM's ``max_num_seqs``; 0: unknown), which the
policies and the processor's default in-flight cap read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.pb import status_pb2
from protocol.routing.spills import SpilledTips

if TYPE_CHECKING:  # protocol.processor.config holds RoutingConfig in ProcessorConfig
    from protocol.processor.keys import EngineKey

__all__ = ["Member", "Pool", "Pools", "reported_load"]


def reported_load(status: status_pb2.EngineStatus) -> tuple[int, float | None, frozenset[str]]:
    """What an engine says of its load: requests in its runtime (running + waiting, else
    in-progress tasks), the highest KV-cache usage reported (None: none), loaded adapters."""
    requests, kv, adapters = 0, None, set()
    for model in status.models:
        if model.HasField("runtime_load"):
            load = model.runtime_load
            requests += load.running_requests + load.waiting_requests
            if load.HasField("kv_cache_usage"):
                kv = load.kv_cache_usage if kv is None else max(kv, load.kv_cache_usage)
            adapters.update(load.loaded_adapters)
        else:
            requests += model.in_progress_task_count
    return requests, kv, frozenset(adapters)


@dataclass(slots=True)
class Member:
    """One engine as routing sees it."""

    key: EngineKey
    #: The id the engine reports, the same on every gateway (``key`` names a peer's engine
    #: with its gateway's pod here).
    reported_id: str = ""
    #: ``EngineStatus.infx_runtime_name``: the runtime it fronts, which other engines may front too.
    runtime: str = ""
    #: The models it takes tasks for now: the pools it is in (none while another engine of its
    #: runtime is the one routed to).
    pools: frozenset[str] = frozenset()
    #: The models it would take tasks for (what the processor says).
    wanted: frozenset[str] = frozenset()
    #: Attached to this gateway (else a peer's).
    local: bool = False
    #: This processor's tasks in flight on it.
    in_flight: int = 0
    #: What it last reported (see the module docstring).
    reported: int = 0
    #: Tasks this processor sent minus those that left since the engine's last report,
    #: which cannot count them yet.
    since_report: int = 0
    kv: float | None = None
    adapters: frozenset[str] = frozenset()
    #: Requests its runtime runs at once (0: it does not say).
    slots: int = 0
    #: This processor's tasks sent to it and that left it, ever (what a report's stamp is compared with).
    sent: int = 0
    left: int = 0
    #: Whether its reports' stamps count what ``sent`` and ``left`` count (see the module docstring).
    stamps_match: bool = True
    #: Its engine's tasks as it reports them (``in_progress_task_count``): for a peer's engine of a
    #: runtime, that peer's tasks there.
    tasks: int = 0
    #: This gateway's own engine of a runtime that peers' engines front too: their tasks there (else None).
    fronts_tasks: int | None = None

    @property
    def ring_id(self) -> str:
        """What a policy hashes it by, the same on every gateway: its runtime's name where it
        reports one, else its engine id."""
        return f"runtime:{self.runtime}" if self.runtime else self.reported_id

    @property
    def load(self) -> int:
        if self.fronts_tasks is not None:
            return self.in_flight + self.fronts_tasks
        return max(self.in_flight, self.reported + self.since_report)


@dataclass(slots=True)
class Pool:
    """The routable engines of one (tenant, model) and their total load."""

    tenant_id: str
    model: str
    members: dict[EngineKey, Member] = field(default_factory=dict)
    total: int = 0


class Pools:
    """Every engine routing knows, by (tenant, model) pool, with loads, adapters and spilled tips."""

    def __init__(self, spilled_tips: int, runtime_slots: bool = True) -> None:
        """``runtime_slots``: take each engine's reported slots (else every member's are 0, unknown)."""
        self._runtime_slots = runtime_slots
        self._members: dict[EngineKey, Member] = {}
        self._pools: dict[tuple[str, str], Pool] = {}
        self.spills = SpilledTips(spilled_tips)
        #: (tenant, runtime name) -> the engines that front it, and the one of them routed to.
        self._fronts: dict[tuple[str, str], dict[EngineKey, None]] = {}
        self._serving: dict[tuple[str, str], EngineKey] = {}
        # Adapter name -> engines that report it loaded.
        self._adapters: dict[str, dict[EngineKey, None]] = {}

    def __len__(self) -> int:
        return len(self._members)

    def pool(self, tenant_id: str, model: str) -> Pool | None:
        """The pool of (tenant, model), or None when no routable engine has the model ready."""
        return self._pools.get((tenant_id, model))

    def member(self, key: EngineKey) -> Member | None:
        return self._members.get(key)

    def holding_adapter(self, adapter: str) -> Iterable[EngineKey]:
        """The engines that report ``adapter`` loaded, in the order they first did."""
        return self._adapters.get(adapter, ())

    def serving(self, key: EngineKey) -> EngineKey:
        """The engine routed to for ``key``'s runtime: ``key`` itself unless it sits out for
        another engine of the same runtime (a peer's record of a spill names its own engine)."""
        member = self._members.get(key)
        if member is None or not member.runtime:
            return key
        return self._serving.get((key.tenant_id, member.runtime), key)

    def spilled_depths(self, blocks: tuple[int, ...]) -> dict[EngineKey, int]:
        """:meth:`SpilledTips.depths`, each by the engine routed to for its runtime (:meth:`serving`)."""
        depths: dict[EngineKey, int] = {}
        for key, depth in self.spills.depths(blocks).items():
            key = self.serving(key)
            if depth > depths.get(key, 0):
                depths[key] = depth
        return depths

    def spilled_holders(self, tip: int) -> list[EngineKey]:
        """:meth:`SpilledTips.holders`, each by the engine routed to for its runtime (:meth:`serving`)."""
        return [self.serving(key) for key in self.spills.holders(tip)]

    def load(self, key: EngineKey) -> int:
        """The load routing counts for ``key`` (0 if unknown)."""
        member = self._members.get(key)
        return 0 if member is None else member.load

    def engine_updated(
        self, key: EngineKey, models: frozenset[str], status: status_pb2.EngineStatus, local: bool,
    ) -> list[Pool]:
        """``key`` takes tasks for ``models`` now (empty: none) and reported ``status``; ``local``:
        attached here (its spilled tips are recorded here), else a peer's (they come in ``status``).
        Returns the pools it joined or left (a pool left empty is gone)."""
        member = self._members.get(key)
        if member is None:
            member = self._members[key] = Member(key, status.engine_id, local=local)
        elif member.local is not local:
            self.spills.forget(key)
        before = (member.runtime, member.local, bool(member.wanted))
        member.local, member.wanted = local, models
        if not local:
            self.spills.reported(key, status)
        reported, member.kv, adapters = reported_load(status)
        member.slots = status.infx_runtime_slots if self._runtime_slots else 0
        self._set_load(member, member.in_flight, reported, self._since_reading(member, status))
        self._set_adapters(member, adapters)
        tasks = sum(model.in_progress_task_count for model in status.models)
        runtime = status.infx_runtime_name
        if not runtime and not member.runtime:
            member.tasks = tasks
            return self._place(member, models)
        if before == (runtime, local, bool(models)):  # which of its runtime's engines is routed to stands
            group = (key.tenant_id, runtime)
            serving = self._serving[group]
            if tasks != member.tasks:
                member.tasks = tasks
                if serving != key:
                    self._count_fronts(group)
            return self._place(member, models if serving == key else frozenset())
        member.tasks = tasks
        changed = self._leave_runtime(member) if member.runtime and member.runtime != runtime else []
        hashed = member.pools
        member.runtime = runtime
        if runtime:
            self._fronts.setdefault((key.tenant_id, runtime), {})[key] = None
            changed += self._settle(key.tenant_id, runtime)
        else:
            changed += self._place(member, models)
        # Its ring id changed with its runtime: the pools it stays in hash it anew.
        return changed + [self._pools[(key.tenant_id, model)] for model in hashed & member.pools]

    def _set_adapters(self, member: Member, adapters: frozenset[str]) -> None:
        if adapters != member.adapters:
            for adapter in member.adapters - adapters:
                holders = self._adapters[adapter]
                del holders[member.key]
                if not holders:
                    del self._adapters[adapter]
            for adapter in sorted(adapters - member.adapters):
                self._adapters.setdefault(adapter, {})[member.key] = None
            member.adapters = adapters

    def _leave_runtime(self, member: Member) -> list[Pool]:
        """``member`` no longer fronts its runtime: another of the runtime's engines may be routed to."""
        group = (member.key.tenant_id, member.runtime)
        fronts = self._fronts[group]
        del fronts[member.key]
        self._set_fronts_tasks(member, None)
        if not fronts:
            del self._fronts[group]
            self._serving.pop(group, None)
            return []
        return self._settle(*group)

    def _settle(self, tenant_id: str, runtime: str) -> list[Pool]:
        """Of the engines that front ``runtime``, the one routed to (this gateway's own, else the
        peer's of least engine id, among those that take tasks) joins its pools; the others sit out."""
        group = (tenant_id, runtime)
        fronts = [self._members[key] for key in self._fronts[group]]
        taking = [m for m in fronts if m.wanted] or fronts
        chosen = min(taking, key=lambda m: (not m.local, m.key.engine_id))
        self._serving[group] = chosen.key
        changed: list[Pool] = []
        for member in fronts:
            if member is not chosen:
                self._set_fronts_tasks(member, None)
            changed += self._place(member, member.wanted if member is chosen else frozenset())
        self._count_fronts(group)
        return changed

    def _count_fronts(self, group: tuple[str, str]) -> None:
        """The engine routed to for a runtime, if this gateway's own, counts the tasks the peers'
        engines of it report (the module docstring)."""
        chosen = self._members[self._serving[group]]
        others = [self._members[key] for key in self._fronts[group] if key != chosen.key]
        self._set_fronts_tasks(chosen, sum(m.tasks for m in others if not m.local)
                               if chosen.local and any(not m.local for m in others) else None)

    def _set_fronts_tasks(self, member: Member, fronts_tasks: int | None) -> None:
        before = member.load
        member.fronts_tasks = fronts_tasks
        self._load_changed(member, before)

    def _place(self, member: Member, models: frozenset[str]) -> list[Pool]:
        """``member`` joins the pools of ``models`` and leaves the others; returns the pools it changed."""
        key = member.key
        changed: list[Pool] = []
        if models != member.pools:
            for model in member.pools - models:
                pool = self._pools[(key.tenant_id, model)]
                del pool.members[key]
                pool.total -= member.load
                changed.append(pool)
                if not pool.members:
                    del self._pools[(key.tenant_id, model)]
            for model in models - member.pools:
                pool = self._pools.setdefault((key.tenant_id, model), Pool(key.tenant_id, model))
                pool.members[key] = member
                pool.total += member.load
                changed.append(pool)
            member.pools = models
        return changed

    def _since_reading(self, member: Member, status: status_pb2.EngineStatus) -> int:
        """This processor's tasks sent to ``member`` since its runtime was read, less those that
        left since, which the report cannot count (0 where it cannot tell: the module docstring)."""
        if not member.local or not member.stamps_match:
            return 0
        for model in status.models:
            load = model.runtime_load
            if model.HasField("runtime_load") and load.HasField("tasks_received"):
                received, ended = int(load.tasks_received), int(load.tasks_ended)
                if received > member.sent or ended > received:
                    member.stamps_match = False
                    return 0
                return (member.sent - received) - max(0, member.left - ended)
        return 0

    def exact_load(self, key: EngineKey, status: status_pb2.EngineStatus) -> None:
        """In ``status``, a copy of local ``key``'s going to peers: the runtime's reading brought up to
        now with this gateway's sends and ends since it (what :meth:`_since_reading` counts), in
        place of the reading and its stamp, which count a stream only this gateway sends on. A peer
        then adds only its own sends after this copy, not the ends this gateway already saw."""
        member = self._members.get(key)
        if member is None or not member.local or not member.stamps_match:
            return
        for model in status.models:
            load = model.runtime_load
            if model.HasField("runtime_load") and load.HasField("tasks_received"):
                load.running_requests = max(0, member.reported + member.since_report - load.waiting_requests)
                load.ClearField("tasks_received")
                load.ClearField("tasks_ended")

    def stream_changed(self, key: EngineKey) -> None:
        """``key`` is reached on another stream now: its stamps count that stream's tasks, not
        this processor's tasks on it, some of which may still be on the old one."""
        member = self._members.get(key)
        if member is not None:
            member.stamps_match = False

    def engine_removed(self, key: EngineKey) -> list[Pool]:
        """``key`` is gone: it leaves every pool; returns those pools."""
        member = self._members.get(key)
        changed: list[Pool] = []
        if member is not None:
            member.wanted = frozenset()
            changed = self._place(member, frozenset())
            if member.runtime:
                changed += self._leave_runtime(member)
            self._set_adapters(member, frozenset())
            del self._members[key]
        self.spills.forget(key)
        return changed

    def task_sent(self, key: EngineKey) -> Member | None:
        """A task was dispatched to ``key``: count it; returns the engine, if routing knows it."""
        member = self._members.get(key)
        if member is not None:
            member.sent += 1
            self._set_load(member, member.in_flight + 1, member.reported, member.since_report + 1)
        return member

    def task_left(self, key: EngineKey) -> None:
        """A task this processor sent to ``key`` left it (ended, failed over)."""
        member = self._members.get(key)
        if member is not None:
            member.left += 1
            self._set_load(member, member.in_flight - 1, member.reported, member.since_report - 1)

    def _set_load(self, member: Member, in_flight: int, reported: int, since_report: int) -> None:
        before = member.load
        member.in_flight, member.reported, member.since_report = in_flight, reported, since_report
        self._load_changed(member, before)

    def _load_changed(self, member: Member, before: int) -> None:
        """``member``'s load was ``before``: the totals of the pools it is in follow its change."""
        delta = member.load - before
        if delta:
            for model in member.pools:
                self._pools[(member.key.tenant_id, model)].total += delta
