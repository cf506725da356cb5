"""The slot-keeping runtime on the real HTTP client, byte by byte: what it asks the runtime, in which order."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.testing import MemoryReactorClock, StringTransport

from infx.agent.runtime_client import RuntimeClient
from infx.agent.runtimes import OpenAIRuntime
from infx.agent.slot_keeping import SlotKeepingRuntime
from protocol.pb import status_pb2, worker_pb2
from tests.support.runtimes import Sink

#: A conversation worth a file: its prompt holds a block (256 bytes) of its own.
QUESTION = b"Hi, " + b"tell me more about it " * 12
BODY = b'{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "' + \
    QUESTION + b'"}]}'


def verbatim_task(task_id: str, body: bytes = BODY) -> worker_pb2.Task:
    task = worker_pb2.Task(id=task_id)
    task.request.http_request.method = "POST"
    task.request.http_request.path = "/v1/chat/completions"
    task.request.http_request.body = body
    return task


def answer(status: int, document: Any) -> bytes:
    body = json.dumps(document).encode()
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


class Upstream:
    """Accepts each connection the client dials and answers each request it writes, in order."""

    def __init__(self, slots: int | None = None) -> None:
        self.reactor = MemoryReactorClock()
        url = "http://runtime.test:8000"
        client = RuntimeClient(self.reactor, url, endpoint=TCP4ClientEndpoint(self.reactor, "runtime.test", 8000))
        self.runtime = SlotKeepingRuntime(OpenAIRuntime(self.reactor, client, url), files=4, engine_id="e", slots=slots)
        #: What the runtime reported of its keeper, in order (the agent's status carries the last).
        self.reports: list[status_pb2.EngineStatus.SlotKeeping] = []
        self.runtime.report = self.reports.append
        self.connections: list[tuple[Any, StringTransport]] = []

    def next_request(self) -> tuple[int, bytes]:
        """The next request written (its connection's index and its bytes), accepting a new connection if need be."""
        while self.reactor.tcpClients:
            _host, _port, factory, _timeout, _bind = self.reactor.tcpClients.pop(0)
            protocol, transport = factory.buildProtocol(None), StringTransport()
            protocol.makeConnection(transport)
            self.connections.append((protocol, transport))
        for i, (_, transport) in enumerate(self.connections):
            if transport.value():
                data = transport.value()
                transport.clear()
                return i, data
        raise AssertionError("no request was written")

    def respond(self, index: int, status: int, document: Any) -> None:
        self.connections[index][0].dataReceived(answer(status, document))


def body_of(request: bytes) -> bytes:
    return request.split(b"\r\n\r\n", 1)[1]


def test_the_slots_come_from_props_each_task_names_its_slot_and_its_slot_is_saved_after() -> None:
    upstream = Upstream()
    sink = Sink()
    upstream.runtime.start(verbatim_task("t1"), sink)
    conn, request = upstream.next_request()
    assert request.startswith(b"GET /props HTTP/1.1\r\n")
    upstream.respond(conn, 200, {"total_slots": 2})
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert body_of(request) == b'{"id_slot":0,' + BODY[1:]  # the client's own body follows byte for byte
    upstream.respond(conn, 200, {"choices": []})
    assert sink.finished == 1 and sink.head.status_code == 200
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /slots/0?action=save HTTP/1.1\r\n")
    assert json.loads(body_of(request)) == {"filename": "infx-e-0.bin"}
    upstream.respond(conn, 200, {"n_saved": 10})
    # The next turn of another conversation takes the other slot, no /props asked again.
    upstream.runtime.start(verbatim_task("t2", BODY.replace(b"Hi,", b"Hello,")), Sink())
    _, request = upstream.next_request()
    assert body_of(request).startswith(b'{"id_slot":1,')


def test_a_waiting_task_gets_the_slot_once_saved_and_its_conversation_is_restored_first() -> None:
    upstream = Upstream(slots=1)
    first, second, third = Sink(), Sink(), Sink()
    upstream.runtime.start(verbatim_task("a1"), first)
    conn, request = upstream.next_request()
    assert body_of(request).startswith(b'{"id_slot":0,')
    other = BODY.replace(b"Be brief.", b"Be long.")
    upstream.runtime.start(verbatim_task("b1", other), second)  # waits: the one slot is busy
    upstream.respond(conn, 200, {"choices": []})
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /slots/0?action=save")
    upstream.respond(conn, 200, {})
    conn, request = upstream.next_request()
    assert body_of(request) == b'{"id_slot":0,' + other[1:]
    upstream.respond(conn, 200, {"choices": []})
    conn, _ = upstream.next_request()  # b1's save
    upstream.respond(conn, 200, {})
    later = BODY[:-2] + b', {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "More"}]}'
    upstream.runtime.start(verbatim_task("a2", later), third)
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /slots/0?action=restore")
    assert json.loads(body_of(request)) == {"filename": "infx-e-0.bin"}  # a1's conversation, a2's opening
    upstream.respond(conn, 200, {})
    _, request = upstream.next_request()
    assert body_of(request) == b'{"id_slot":0,' + later[1:]
    assert upstream.reports[-1] == status_pb2.EngineStatus.SlotKeeping(restored=1, cold=2, saved=2)


def test_a_runtime_without_props_is_not_kept_and_bodies_go_unchanged() -> None:
    upstream = Upstream()
    upstream.runtime.start(verbatim_task("t1"), Sink())
    conn, request = upstream.next_request()
    assert request.startswith(b"GET /props")
    upstream.respond(conn, 404, {"error": "no"})
    conn, request = upstream.next_request()
    assert body_of(request) == BODY
    upstream.respond(conn, 200, {"choices": []})
    upstream.runtime.start(verbatim_task("t2"), Sink())
    _, request = upstream.next_request()
    assert request.startswith(b"POST /v1/chat/completions") and body_of(request) == BODY
    assert upstream.runtime.off
    assert upstream.reports == [status_pb2.EngineStatus.SlotKeeping(off=True)]


def test_a_body_naming_its_own_slot_and_an_aborted_waiting_task_leave_the_slots_alone() -> None:
    upstream = Upstream(slots=1)
    upstream.runtime.start(verbatim_task("a1"), Sink())
    conn, _ = upstream.next_request()
    own = b'{"id_slot": 0, "model": "m", "messages": [{"role": "user", "content": "x"}]}'
    upstream.runtime.start(verbatim_task("own", own), Sink())  # runs where the runtime puts it, at once
    _, request = upstream.next_request()
    assert body_of(request) == own
    waiting = upstream.runtime.start(verbatim_task("b1", BODY.replace(b"Hi,", b"Yo,")), Sink())
    waiting.abort()
    upstream.respond(conn, 200, {"choices": []})
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /slots/0?action=save")
    upstream.respond(conn, 200, {})
    assert upstream.runtime.keeper is not None and upstream.runtime.keeper.waiting == 0
    assert not any(t.value() for _, t in upstream.connections)  # b1 never ran


def test_a_short_question_past_its_system_prompt_runs_in_a_kept_slot_but_is_not_saved() -> None:
    upstream = Upstream(slots=1)
    short = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
    upstream.runtime.start(verbatim_task("s1", short), Sink())
    conn, request = upstream.next_request()
    assert body_of(request).startswith(b'{"id_slot":0,')
    upstream.respond(conn, 200, {"choices": []})
    upstream.runtime.start(verbatim_task("a1"), Sink())  # no save came first: the slot is free at once
    _, request = upstream.next_request()
    assert request.startswith(b"POST /v1/chat/completions")


def test_a_refused_save_turns_keeping_off_and_the_report_says_so_with_what_was_done() -> None:
    upstream = Upstream(slots=1)
    upstream.runtime.start(verbatim_task("a1"), Sink())
    conn, _ = upstream.next_request()
    upstream.respond(conn, 200, {"choices": []})
    conn, request = upstream.next_request()
    assert request.startswith(b"POST /slots/0?action=save")
    upstream.respond(conn, 501, {"error": {"message": "This server does not support slot saving"}})
    assert upstream.runtime.off
    assert upstream.reports[-1] == status_pb2.EngineStatus.SlotKeeping(cold=1, failed=1, off=True)
    upstream.runtime.start(verbatim_task("a2"), Sink())
    _, request = upstream.next_request()
    assert body_of(request) == BODY  # as without keeping
