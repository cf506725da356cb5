"""The engine agent's runtimes: echo on a stepped clock, and the
openai runtime against a small OpenAI-compatible twisted.web server on loopback."""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.web import resource, server
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.python.failure import Failure

from infx.agent.runtime_client import RuntimeClient
from infx.agent.runtimes import EchoRuntime, OpenAIRuntime, upstream_root
from protocol.agent.echo import EchoConfig
from protocol.pb import audio_pb2, embeddings_pb2, worker_pb2
from tests.support.runtimes import Sink, chat_task


def embed_task(text: str, model: str = "m") -> worker_pb2.Task:
    req = embeddings_pb2.CreateEmbeddingRequest(model=model, input=text)
    return worker_pb2.Task(id="e1", request=worker_pb2.TaskRequest(embedding=req))


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_upstream_url_may_name_the_root_or_v1(url: str) -> None:
    assert upstream_root(url) == "http://h:8000"


# -- echo ---------------------------------------------------------------------------------


def test_echo_streams_word_by_word_as_chunk_events_at_the_token_delay() -> None:
    clock = task.Clock()
    clock.advance(1000)
    sink = Sink()
    EchoRuntime(clock, EchoConfig(token_delay=0.5)).start(chat_task("hello big world", stream=True, usage=True),
                                                          sink)
    clock.advance(0)
    assert sink.head.status_code == 200
    assert list(sink.head.header["Content-Type"].values) == ["text/event-stream"]
    first = len(sink.results)
    clock.advance(0.5)
    assert len(sink.results) == first + 1
    clock.advance(1.0)
    assert sink.finished == 1
    datas = [e.data for e in sink.events]
    assert all(d.startswith(b"data: ") and d.endswith(b"\n\n") for d in datas[:-1])
    # As LLMariner's engines do: [DONE] is relayed as an event, then an empty last event.
    assert datas[-2:] == [b"data: [DONE]\n\n", b""]
    assert [e.is_last_event for e in sink.events[-2:]] == [False, True]
    chunks = [json.loads(d[len(b"data: "):]) for d in datas[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hello big world"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_echo_answers_a_non_streamed_chat_with_one_json_body() -> None:
    clock = task.Clock()
    sink = Sink()
    EchoRuntime(clock, EchoConfig(token_delay=0.0)).start(chat_task("just this"), sink)
    clock.advance(0)
    assert sink.finished == 1 and len(sink.results) == 1
    body = json.loads(sink.head.body)
    assert body["choices"][0]["message"]["content"] == "just this"


def test_echo_embeddings_are_deterministic_vectors_derived_from_the_input() -> None:
    clock = task.Clock()
    vectors = []
    for text in ("a", "a", "b"):
        sink = Sink()
        EchoRuntime(clock, EchoConfig()).start(embed_task(text), sink)
        clock.advance(0)
        vectors.append(json.loads(sink.head.body)["data"][0]["embedding"])
    assert vectors[0] == vectors[1] != vectors[2]


def test_echo_abort_stops_the_remaining_results() -> None:
    clock = task.Clock()
    sink = Sink()
    running = EchoRuntime(clock, EchoConfig(token_delay=1.0)).start(chat_task("a b c d", stream=True), sink)
    clock.advance(1.0)
    count = len(sink.results)
    running.abort()
    clock.advance(10.0)
    assert len(sink.results) == count and sink.finished == 0


# -- openai runtime against a loopback OpenAI-compatible server -------------------------------


class FakeRuntime(resource.Resource):
    """A tiny OpenAI-compatible server: scripted by the request's model name."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[bytes, dict, dict[bytes, list[bytes]]]] = []
        self.lost: defer.Deferred[str] = defer.Deferred()

    def render_POST(self, request: server.Request) -> bytes | int:
        raw = request.content.read()
        headers = dict(request.requestHeaders.getAllRawHeaders())
        if request.path == b"/v1/audio/transcriptions":
            self.requests.append((request.path, {"raw": raw.decode("latin-1")}, headers))
            request.setHeader(b"content-type", b"application/json")
            return b'{"text":"heard"}'
        body = json.loads(raw)
        self.requests.append((request.path, body, headers))
        model = body.get("model")
        if model == "broken":
            request.setResponseCode(400)
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"x-runtime", b"yes")
            return b'{"error":{"message":"bad model","type":"invalid_request_error"}}'
        if model == "hang":
            request.notifyFinish().addBoth(lambda _: self.lost.callback("lost"))
            return server.NOT_DONE_YET
        if body.get("stream"):
            request.setHeader(b"content-type", b"text/event-stream")
            big = "y" * 100_000
            events = [
                b'data: {"n":1}\n\n',
                b'event: message\r\ndata: {"n":2,"big":"' + big.encode() + b'"}\r\n\r\n',
                b"data: [DONE]\n\n",
            ]
            if model == "hang-stream":
                request.notifyFinish().addBoth(lambda _: self.lost.callback("lost"))
                request.write(events[0])
                return server.NOT_DONE_YET
            if model == "burst":
                request.write(b"".join(events))  # one write: the relay reads the events together
                request.finish()
                return server.NOT_DONE_YET

            def write(rest: list[bytes]) -> None:
                if not rest:
                    request.finish()
                    return
                # Cut each event in two writes so the relay has to reassemble it.
                head, tail = rest[0][:7], rest[0][7:]
                request.write(head)
                request.write(tail)
                reactor.callLater(0.001, write, rest[1:])

            write(events)
            return server.NOT_DONE_YET
        request.setHeader(b"content-type", b"application/json")
        return json.dumps({"object": "chat.completion", "echo": body}).encode()


@pytest.fixture
def fake_runtime():
    fake = FakeRuntime()
    port = pytest_twisted.blockon(TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
        server.Site(fake)))
    url = f"http://127.0.0.1:{port.getHost().port}/v1"
    client = RuntimeClient(reactor, url)
    runtime = OpenAIRuntime(reactor, client, url)
    yield fake, runtime
    pytest_twisted.blockon(client.close())
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


@pytest_twisted.inlineCallbacks
def test_openai_non_streamed_chat_posts_openai_json_and_relays_the_body(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    runtime.start(chat_task("hi there"), sink)
    yield sink.done
    path, body, headers = fake.requests[0]
    assert path == b"/v1/chat/completions"
    assert body["model"] == "m" and body["messages"][0]["role"] == "user"
    assert headers[b"X-Request-Id"] == [b"req-1"]
    assert b"Authorization" not in headers, "the client's credentials stay with the gateway"
    assert sink.head.status_code == 200 and sink.head.status == "200 OK"
    assert list(sink.head.header["Content-Type"].values) == ["application/json"]
    assert json.loads(sink.head.body)["echo"]["model"] == "m"
    assert len(sink.results) == 1


@pytest_twisted.inlineCallbacks
def test_openai_streamed_chat_relays_each_event_verbatim_then_the_last_event(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    runtime.start(chat_task("hi", stream=True), sink)
    yield sink.done
    assert sink.head.status_code == 200 and sink.head.body == b""
    assert list(sink.head.header["Content-Type"].values) == ["text/event-stream"]
    datas = [e.data for e in sink.events]
    assert datas[0] == b'data: {"n":1}\n\n'
    assert datas[1].startswith(b"event: message\r\ndata: {\"n\":2") and len(datas[1]) > 100_000
    assert datas[2] == b"data: [DONE]\n\n"
    assert sink.events[3].is_last_event and sink.events[3].data == b""
    assert len(sink.events) == 4


@pytest_twisted.inlineCallbacks
def test_openai_runtime_error_status_headers_and_body_pass_through(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    runtime.start(embed_task("x", model="broken"), sink)
    yield sink.done
    assert fake.requests[0][0] == b"/v1/embeddings"
    assert sink.head.status_code == 400 and sink.head.status == "400 Bad Request"
    assert list(sink.head.header["X-Runtime"].values) == ["yes"]
    assert json.loads(sink.head.body)["error"]["message"] == "bad model"


@pytest_twisted.inlineCallbacks
def test_openai_streamed_request_with_error_status_is_one_http_response(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    runtime.start(chat_task("x", model="broken", stream=True), sink)
    yield sink.done
    assert [r.WhichOneof("message") for r in sink.results] == ["http_response"]
    assert sink.head.status_code == 400


@pytest_twisted.inlineCallbacks
def test_openai_audio_is_posted_as_multipart(fake_runtime):
    fake, runtime = fake_runtime
    req = audio_pb2.CreateAudioTranscriptionRequest(model="whisper", file=b"RIFF..", filename="a.wav")
    sink = Sink()
    runtime.start(worker_pb2.Task(id="a1", request=worker_pb2.TaskRequest(audio_transcription=req)), sink)
    yield sink.done
    path, body, headers = fake.requests[0]
    assert path == b"/v1/audio/transcriptions"
    assert headers[b"Content-Type"][0].startswith(b"multipart/form-data; boundary=")
    assert 'name="file"; filename="a.wav"' in body["raw"] and "RIFF.." in body["raw"]
    assert json.loads(sink.head.body) == {"text": "heard"}


@pytest_twisted.inlineCallbacks
def test_openai_connection_refused_becomes_503_so_the_gateway_retries_elsewhere():
    endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
    port = yield endpoint.listen(server.Site(resource.Resource()))
    free = port.getHost().port
    yield port.stopListening()
    runtime = OpenAIRuntime(reactor, RuntimeClient(reactor, f"http://127.0.0.1:{free}"), f"http://127.0.0.1:{free}")
    sink = Sink()
    runtime.start(chat_task("x"), sink)
    yield sink.done
    assert sink.head.status_code == 503 and sink.results[0].infx_runtime_failure == worker_pb2.RUNTIME_UNREACHABLE
    assert json.loads(sink.head.body)["error"] == {
        "message": "The engine could not reach its runtime; retry later.", "type": "server_error", "param": None,
        "code": "runtime_unreachable"}


@pytest_twisted.inlineCallbacks
def test_openai_abort_before_the_response_closes_the_upstream_request(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    running = runtime.start(chat_task("x", model="hang"), sink)
    while not fake.requests:
        yield task.deferLater(reactor, 0.005, lambda: None)
    running.abort()
    assert (yield fake.lost) == "lost"
    assert sink.results == [] and sink.finished == 0


@pytest_twisted.inlineCallbacks
def test_openai_abort_mid_stream_closes_the_upstream_connection(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    running = runtime.start(chat_task("x", model="hang-stream", stream=True), sink)
    while len(sink.results) < 2:
        yield task.deferLater(reactor, 0.005, lambda: None)
    running.abort()
    assert (yield fake.lost) == "lost"
    assert len(sink.results) == 2 and sink.finished == 0


# -- the openai runtime on a memory transport: exact about what happens after an abort or a pause


class MemoryUpstream:
    """The openai runtime's real HTTP client, its connection a StringTransport on a Clock:
    the test writes the runtime's answer byte by byte and sees exactly what the client does."""

    def __init__(self) -> None:
        self.reactor = MemoryReactorClock()
        url = "http://runtime.test:8000"
        client = RuntimeClient(self.reactor, url, endpoint=TCP4ClientEndpoint(self.reactor, "runtime.test", 8000))
        self.runtime = OpenAIRuntime(self.reactor, client, url)
        self.transport = StringTransport()
        self.protocol: Any = None

    def connect(self) -> bytes:
        """Accept the client's connection; returns the request it wrote."""
        _host, _port, factory, _timeout, _bind = self.reactor.tcpClients.pop()
        self.protocol = factory.buildProtocol(None)
        self.protocol.makeConnection(self.transport)
        return self.transport.value()

    def answer(self, data: bytes) -> None:
        self.protocol.dataReceived(data)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_runtime_mounted_below_its_hosts_root_is_asked_there() -> None:
    reactor_ = MemoryReactorClock()
    url = "http://proxy.test:8080/llama/v1"
    client = RuntimeClient(reactor_, url, endpoint=TCP4ClientEndpoint(reactor_, "proxy.test", 8080))
    OpenAIRuntime(reactor_, client, url).start(chat_task("x"), Sink())
    _host, _port, factory, _timeout, _bind = reactor_.tcpClients.pop()
    protocol = factory.buildProtocol(None)
    transport = StringTransport()
    protocol.makeConnection(transport)
    assert transport.value().startswith(b"POST /llama/v1/chat/completions HTTP/1.1\r\nHost: proxy.test:8080\r\n")


def test_nothing_is_relayed_after_an_abort_mid_stream_and_the_upstream_read_stops() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    running = upstream.runtime.start(chat_task("x", stream=True), sink)
    assert upstream.connect().startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    upstream.answer(STREAM_HEAD + chunk(b'data: {"n":1}\n\n'))
    assert [r.WhichOneof("message") for r in sink.results] == ["http_response", "server_sent_event"]
    running.abort()
    assert upstream.transport.disconnected, "the connection is aborted: the runtime stops generating"
    upstream.answer(chunk(b'data: {"n":2}\n\n') + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    upstream.reactor.advance(60)
    assert len(sink.results) == 2 and sink.finished == 0


def test_an_abort_while_the_whole_body_is_read_stops_the_read_and_reports_nothing() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    running = upstream.runtime.start(embed_task("x"), sink)
    assert upstream.connect().startswith(b"POST /v1/embeddings HTTP/1.1\r\n")
    upstream.answer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
                    b'{"partial":')
    assert sink.results == []
    running.abort()
    assert upstream.transport.disconnected
    upstream.answer(b" " * 89)  # the rest of the body
    upstream.reactor.advance(60)
    assert sink.results == [] and sink.finished == 0


def test_an_abort_before_the_answer_aborts_the_connection() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    running = upstream.runtime.start(chat_task("x"), sink)
    upstream.connect()
    running.abort()
    assert upstream.transport.disconnecting
    upstream.reactor.advance(60)
    assert sink.results == [] and sink.finished == 0


def test_a_full_grpc_stream_pauses_the_upstream_read_until_it_drains() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    sink.blocked = defer.Deferred()
    upstream.runtime.start(chat_task("x", stream=True), sink)
    upstream.connect()
    upstream.answer(STREAM_HEAD + chunk(b'data: {"n":0}\n\n'))
    assert len(sink.results) == 2
    assert upstream.transport.producerState == "paused", "nothing more is read while the sink is blocked"
    blocked, sink.blocked = sink.blocked, None
    blocked.callback(None)
    assert upstream.transport.producerState == "producing"
    upstream.answer(b"".join(chunk(b'data: {"n":%d}\n\n' % i) for i in range(1, 50)) + b"0\r\n\r\n")
    assert sink.finished == 1
    assert len(sink.events) == 51 and sink.events[-1].is_last_event


# -- openai runtime: a task that carries the client's request verbatim -------------------------------


def verbatim_task(path: str, body: bytes, *, stream: bool = False, **headers: list[str]) -> worker_pb2.Task:
    task = worker_pb2.Task(id="v1")
    task.request.chat_completion.model = "m"
    task.request.chat_completion.stream = stream
    task.request.typed_request_incomplete = "routing fields only"
    task.request.http_request.CopyFrom(worker_pb2.HttpRequest(method="POST", path=path, body=body))
    for name, values in headers.items():
        task.header[name.replace("_", "-")].values.extend(values)
    return task


@pytest_twisted.inlineCallbacks
def test_openai_runs_a_verbatim_request_as_it_came_and_marks_the_answer(fake_runtime):
    fake, runtime = fake_runtime
    body = b'{"model": "m", "messages": [], "seed": 0,  "top_k": 5}'
    sink = Sink()
    runtime.start(verbatim_task("/v1/chat/completions?x=1", body, Content_Type=["application/json; charset=utf-8"],
                                User_Agent=["OpenAI/Python 9"], X_Custom=["a", "b"], Authorization=["Bearer sk"],
                                Accept_Encoding=["gzip"]), sink)
    yield sink.done
    path, received, headers = fake.requests[0]
    assert path == b"/v1/chat/completions"
    assert received == json.loads(body)
    assert headers[b"Content-Type"] == [b"application/json; charset=utf-8"]
    assert headers[b"User-Agent"] == [b"OpenAI/Python 9"] and headers[b"X-Custom"] == [b"a", b"b"]
    assert b"Authorization" not in headers and b"Accept-Encoding" not in headers
    assert sink.results[0].verbatim_answer


@pytest_twisted.inlineCallbacks
def test_openai_streams_a_verbatim_request_by_its_routing_stream_flag(fake_runtime):
    fake, runtime = fake_runtime
    sink = Sink()
    runtime.start(verbatim_task("/v1/chat/completions", b'{"model":"m","stream":true}', stream=True,
                                Content_Type=["application/json"]), sink)
    yield sink.done
    assert sink.results[0].verbatim_answer
    assert [e.data for e in sink.events][0] == b'data: {"n":1}\n\n'
    assert sink.events[-1].is_last_event


@pytest_twisted.inlineCallbacks
def test_a_verbatim_streams_events_read_together_go_on_as_one_piece_and_a_typed_ones_one_by_one(fake_runtime):
    fake, runtime = fake_runtime
    verbatim, typed = Sink(), Sink()
    runtime.start(verbatim_task("/v1/chat/completions", b'{"model":"burst","stream":true}', stream=True), verbatim)
    runtime.start(chat_task("hi", model="burst", stream=True), typed)
    yield defer.gatherResults([verbatim.done, typed.done])
    pieces, events = [e.data for e in verbatim.events[:-1]], [e.data for e in typed.events[:-1]]
    assert len(events) == 3 and events[2] == b"data: [DONE]\n\n"
    assert b"".join(pieces) == b"".join(events) and len(pieces) < len(events)
    assert verbatim.events[-1].is_last_event and verbatim.events[-1].data == b""


@pytest_twisted.inlineCallbacks
def test_openai_sends_a_verbatim_multipart_body_with_the_clients_content_type(fake_runtime):
    fake, runtime = fake_runtime
    form = (b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--b\r\nContent-Disposition: form-data;'
            b' name="file"; filename="a.mp3"\r\nContent-Type: audio/mpeg\r\n\r\nID3\x00\r\n--b--\r\n')
    task = verbatim_task("/v1/audio/transcriptions", form, Content_Type=["multipart/form-data; boundary=b"])
    task.request.ClearField("chat_completion")
    task.request.audio_transcription.model = "m"
    sink = Sink()
    runtime.start(task, sink)
    yield sink.done
    _, received, headers = fake.requests[0]
    assert received["raw"].encode("latin-1") == form
    assert headers[b"Content-Type"] == [b"multipart/form-data; boundary=b"]


def test_the_openai_runtime_announces_that_it_takes_verbatim_requests():
    from infx.agent.runtimes import CAPABILITIES
    from protocol.agent.core import EngineAgentCore
    from protocol.agent.effects import AgentConfig
    from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY

    core = EngineAgentCore(AgentConfig(engine_id="e", models=("m",), capabilities=CAPABILITIES))
    assert list(core.engine_status().infx_capabilities) == [HTTP_REQUEST_CAPABILITY]
    assert not EngineAgentCore(AgentConfig(engine_id="e", models=("m",))).engine_status().infx_capabilities


@pytest.mark.parametrize("path, method", [("v1/x", "POST"), ("/v1/x\r\nX-Evil: 1", "POST"), ("/v1/a b", "POST"),
                                          ("/v1/x", "PO ST")])
def test_openai_refuses_a_verbatim_request_line_no_runtime_should_see(fake_runtime, path, method):
    fake, runtime = fake_runtime
    task = verbatim_task(path, b"{}")
    task.request.http_request.method = method
    sink = Sink()
    runtime.start(task, sink)
    assert sink.finished == 1 and sink.head.status_code == 400 and not fake.requests


@pytest.mark.parametrize(("status_line", "relayed"), [
    (b"HTTP/1.1 522 Origin Connection Time-out", "522 Origin Connection Time-out"),
    (b"HTTP/1.1 599 ", "599"),
    (b"HTTP/1.1 200 Fine", "200 Fine"),
])
def test_a_runtimes_status_outside_the_registry_is_relayed_with_its_own_reason(status_line, relayed) -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(chat_task("x"), sink)
    upstream.connect()
    upstream.answer(status_line + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    assert sink.finished == 1
    assert (sink.head.status_code, sink.head.status, sink.head.body) == (int(status_line.split()[1]), relayed, b"{}")



# --- a runtime that fails the task: what the agent tells the gateway (issue #22) ------------

SSE_CLOSE_DELIMITED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def no_internals(data: bytes) -> None:
    """What a client may read: no Python repr, no Twisted class name."""
    for word in (b"Failure", b"twisted", b"ConnectionDone", b"ConnectionLost", b"_DataLoss", b"CHUNK_LENGTH", b"<"):
        assert word not in data, data


def test_a_runtime_that_closes_the_connection_after_reading_the_request_is_reported_dropped() -> None:
    """The issue's crash: the request was written whole and the connection closed with no answer.
    The runtime may have died of this request, so the gateway must not treat it as unreachable
    (which it may retry freely): a 502 marked RUNTIME_DROPPED, in fixed words."""
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(chat_task("x"), sink)
    assert upstream.connect().startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    upstream.protocol.connectionLost(Failure(ConnectionDone("Connection was closed cleanly.")))
    assert sink.finished == 1 and sink.results[0].infx_runtime_failure == worker_pb2.RUNTIME_DROPPED
    error = json.loads(sink.head.body)["error"]
    assert (sink.head.status_code, error["type"], error["code"]) == (502, "upstream_error", "runtime_dropped")
    no_internals(sink.head.body)


def test_an_answer_broken_off_after_its_status_line_is_reported_dropped() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(embed_task("x"), sink)
    upstream.connect()
    upstream.answer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"da")
    upstream.protocol.connectionLost(Failure(ConnectionLost("reset")))
    assert sink.finished == 1 and sink.results[0].infx_runtime_failure == worker_pb2.RUNTIME_DROPPED
    assert json.loads(sink.head.body)["error"]["code"] == "runtime_dropped"
    no_internals(sink.head.body)


def test_a_chunked_stream_cut_short_ends_with_an_error_event_and_no_done() -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(chat_task("x", stream=True), sink)
    upstream.connect()
    upstream.answer(STREAM_HEAD + chunk(b'data: {"n":1}\n\n') + b"2a\r\ndata: {")
    upstream.protocol.connectionLost(Failure(ConnectionLost("non-clean")))
    assert sink.finished == 1
    datas = [e.data for e in sink.events]
    assert datas[0] == b'data: {"n":1}\n\n' and sink.events[-1].is_last_event and not datas[-1]
    error = json.loads(datas[1].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "runtime_stream_broken")
    assert not any(b"[DONE]" in d for d in datas)
    no_internals(datas[1])


def test_an_unframed_stream_closed_before_its_final_event_ends_with_an_error_event() -> None:
    """No chunked framing and no length: the body ends where the connection does, so a runtime
    that dies mid-stream looks like one that finished. Only a final event tells them apart."""
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(chat_task("x", stream=True), sink)
    upstream.connect()
    upstream.answer(SSE_CLOSE_DELIMITED + b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    upstream.protocol.connectionLost(Failure(ConnectionDone("closed")))
    datas = [e.data for e in sink.events]
    assert len(datas) == 3 and b"runtime_stream_broken" in datas[1] and sink.events[-1].is_last_event


@pytest.mark.parametrize("final", [
    b"data: [DONE]\n\n",
    b"data: [DONE]",
    b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
])
def test_an_unframed_stream_that_reached_its_final_event_ended_as_the_runtime_meant(final) -> None:
    upstream = MemoryUpstream()
    sink = Sink()
    upstream.runtime.start(chat_task("x", stream=True), sink)
    upstream.connect()
    upstream.answer(SSE_CLOSE_DELIMITED + b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + final)
    upstream.protocol.connectionLost(Failure(ConnectionDone("closed")))
    datas = [e.data for e in sink.events]
    assert len(datas) == 3 and datas[1].startswith(final.rstrip(b"\n")) and not datas[2]
    assert not any(b"error" in d for d in datas)
