"""What a runtime's answer says it still held (issue #24, part 4): an answer that reused far less of
a prompt than the prefix index held on its engine says the runtime evicted it, and the index
forgets it and whatever was sent there before it, so a later turn of a conversation so evicted no
longer waits for a busy engine that holds no more of it than another. Pure: the index, the affinity
policy on hand-made pools, and a processor fed results by hand (no clock, no reactor)."""

from __future__ import annotations

import json

from protocol.processor.core import Processor, ProcessorConfig, SendTask
from protocol.processor.keys import EngineKey, Locality
from protocol.routing.config import RoutingConfig
from protocol.routing.prefix_index import PrefixIndex
from tests.support.processor import chat, engine_status, http, one, sse
from protocol.routing.hints import RoutingHints
from tests.support.routing import SYSTEM, Gateway, conversation_hints

E0, E1 = EngineKey("t", "e0"), EngineKey("t", "e1")


def user(n: int, turns: int = 1) -> RoutingHints:
    """User ``n`` of one application (a shared system prompt), each turn longer than a block, so that
    the index holds a turn's own part past the shared one."""
    hints = conversation_hints(n, turns, SYSTEM, question_repeats=30)
    assert hints.home_blocks and len(hints.blocks) >= hints.home_blocks + 2 * turns
    return hints


def test_the_index_forgets_what_an_engine_evicted_and_everything_sent_there_before_it():
    index = PrefixIndex(per_engine=100, total=1000)
    index.record(E0, (1, 2, 10, 11))   # stamp 1: a conversation under a shared head (1, 2)
    index.record(E0, (1, 2, 20, 21))   # stamp 2: another
    index.record(E1, (1, 2, 30))       # stamp 3, elsewhere
    index.record(E0, (1, 2, 40))       # stamp 4: the head sent again
    assert index.stamps(E0, (1, 2, 20, 21, 99)) == (4, 4, 2, 2)
    index.evict_through(E0, 2)
    assert index.depths((1, 2, 10, 11)) == {E0: 2, E1: 2}   # the head was sent again since: kept
    assert index.depths((1, 2, 20, 21)) == {E0: 2, E1: 2}
    assert index.depths((1, 2, 40)) == {E0: 3, E1: 2}
    assert index.depths((1, 2, 30)) == {E0: 2, E1: 3}       # another engine's entries stay
    assert index.size == 3 + 3


def evicted_answer(g: Gateway, engine: EngineKey, n: int, turns: int, cached_share: float) -> None:
    """User ``n``'s turn ``turns`` is answered by ``engine`` saying it reused ``cached_share`` of the prompt."""
    hints = user(n, turns=turns)
    g.policy.task_answered(engine, "m", hints, 1000, round(1000 * cached_share))
    g.finish(engine, hints)


def busy(g: Gateway, engine: EngineKey, tasks: int) -> None:
    for _ in range(tasks):
        g.pools.task_sent(engine)


def test_a_later_turn_whose_engine_evicted_it_no_longer_waits_for_that_engine():
    """Three users' first turns on one engine, 2 then 0 then 1; user 0's second turn comes back with
    little more than the shared system prompt cached: the runtime evicted user 0's first turn, and
    user 2's, older. That engine's slots busy, user 5's first turn goes to another, which then holds
    the system prompt too. User 2's next turn goes there (nothing of its own is held anywhere), while
    user 1, sent to the first engine later, and user 0, whose second turn it has just computed, still
    wait for it."""
    g = Gateway(("e0", "e1", "e2"))
    first = g.send(user(2))
    g.finish(first, user(2))
    for n in (0, 1):
        assert g.send(user(n)) == first
        g.finish(first, user(n))
    assert g.send(user(0, turns=2)) == first
    evicted_answer(g, first, 0, 2, cached_share=0.2)
    shared = user(2, turns=2).home_blocks
    assert g.policy.index.depths(user(2, turns=2).blocks)[first] == shared
    assert g.policy.index.depths(user(1, turns=2).blocks)[first] > shared
    busy(g, first, 2)
    other = g.send(user(5))
    assert other != first
    g.finish(other, user(5))
    for n in (1, 0):
        assert g.send(user(n, turns=3 if n == 0 else 2)) == first
        g.finish(first, user(n, turns=3 if n == 0 else 2))
    assert g.send(user(2, turns=2)) == other


def test_an_answer_that_reused_what_the_index_held_changes_nothing():
    g = Gateway(("e0", "e1", "e2"))
    first = g.send(user(0))
    g.finish(first, user(0))
    later = user(0, turns=2)
    assert g.send(later) == first
    before = g.policy.index.depths(later.blocks)
    g.policy.task_answered(first, "m", later, 1000, 900)
    g.finish(first, later)
    assert g.policy.index.depths(later.blocks) == before
    busy(g, first, 2)
    assert g.send(user(0, turns=3)) == first  # it waits for its engine


def test_an_answer_is_checked_once_and_only_against_what_was_held_when_its_task_was_sent():
    """A first turn (nothing of its own held) says nothing of evictions whatever it reused; a second
    answer to one task is not checked again; a task that left before its answer leaves nothing."""
    g = Gateway(("e0", "e1", "e2"))
    first = g.send(user(0))
    g.policy.task_answered(first, "m", user(0), 1000, 0)
    g.finish(first, user(0))
    assert g.policy.state_size()["expected"] == 0
    later = user(0, turns=2)
    g.send(later)
    assert g.policy.state_size()["expected"] == 1
    g.finish(first, later)
    assert g.policy.state_size()["expected"] == 0
    g.policy.task_answered(first, "m", later, 1000, 0)
    assert g.policy.index.depths(later.blocks)[first] == len(later.blocks)


def test_the_processor_tells_routing_what_each_answer_reused():
    """A streamed answer's last event carries the runtime's ``timings``: the processor hands them to
    the router once, with the task's hints and engine."""
    processor = Processor(ProcessorConfig(routing=RoutingConfig()))
    for engine_id in ("e0", "e1", "e2"):
        status = engine_status(engine_id, "m")
        status.infx_runtime_slots = 2
        processor.update_engine(("route", engine_id), "t", status, Locality.REMOTE, 0.0)
    answered: list[tuple[str, int, int]] = []
    router = processor._router
    router.task_answered = lambda key, model, hints, prompt, cached: answered.append((key.engine_id, prompt, cached))
    sent = one(processor.submit(now=0.0, task_id="x", tenant_id="t", request=chat(stream=True), origin="o",
                                hints=user(3, turns=2)), SendTask)
    processor.receive_result(sent.route, http(sent.task.id), 0.0)
    processor.receive_result(sent.route, sse(sent.task.id, 1, data=b'data: {"choices": []}\n\n'), 0.0)
    timings = json.dumps({"choices": [], "timings": {"cache_n": 700, "prompt_n": 300}}).encode()
    processor.receive_result(sent.route, sse(sent.task.id, 2, last=True, data=b"data: " + timings + b"\n\n"), 0.0)
    assert answered == [(sent.engine.engine_id, 1000, 700)]
