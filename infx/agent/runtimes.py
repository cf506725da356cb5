"""Runtimes the engine agent runs tasks on: the built-in ``echo`` and any ``openai``-compatible server.

A runtime takes a runtime task (chat, embedding, audio, response, tokenize)
and reports its results to a :class:`TaskSink`: the ``HttpResponse`` first,
then, for a streamed answer, one ``ServerSentEvent`` per event and a last
one with ``is_last_event``; then ``finish()``. Task ids and result indexes
are stamped by the agent's core, so a runtime need not set them. A runtime
must stop reporting once aborted (the agent drops stray results anyway).

The ``openai`` runtime runs a task that carries the client's request
verbatim (``TaskRequest.http_request``, see :mod:`protocol.openai.task_forms`) as it
is: the client's method, path, body and headers (but hop-by-hop ones,
``Authorization``, ``Cookie``, ``Content-Length``, ``Host``, ``Accept-Encoding``
and ``Expect``, which belong to this hop), and marks the answer ``verbatim_answer`` so that the
gateway relays it unchanged; it announces this with
:data:`CAPABILITIES`. A task with only the typed form (from a gateway that
does not know the capability) is converted by :mod:`protocol.openai.runtime`.

A runtime that fails a task is reported in the words of
:mod:`protocol.agent.runtime_failures`: one it could not reach (503, never read:
the gateway may send the task elsewhere), one that read the request and
dropped the connection or broke off its answer (502: sent again at most
once), a stream cut short (its chunked framing broken, or an unframed stream
closed before its final event: an error event ends it). The client reads a
fixed message; what the socket said goes to this process's log.

The ``openai`` runtime's upstream URL is the server's root
(``http://127.0.0.1:8000``); a trailing ``/v1`` is accepted and dropped,
because the endpoints are those LLMariner's engine uses:
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``,
``/v1/audio/transcriptions`` and vLLM's ``/tokenize``, which vLLM serves at
the root, not under ``/v1``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectError, DNSLookupError
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol as TwistedProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.web.client import (
    URI, Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool, RequestGenerationFailed, RequestTransmissionFailed,
    ResponseDone,
)
from twisted.web.error import SchemeNotSupported
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from infx.agent.upstream_key import UpstreamKey
from protocol.agent.echo import EchoConfig, echo_task
from protocol.agent.runtime_failures import RuntimeFailure, broken_stream_event, failure_result
from protocol.openai.errors import InvalidRequestError, OpenAIUsageError, OpenAIError, UpstreamError, status_line
from protocol.openai.observe import ends_stream
from protocol.openai.runtime import RuntimeRequest, runtime_request
from protocol.openai.sse import DEFAULT_MAX_EVENT_SIZE, EventTooLarge, SSEBlockSplitter
from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY
from protocol.pb import worker_pb2
from protocol.processor.requests import is_streaming

__all__ = [
    "EchoRuntime", "OpenAIRuntime", "Runtime", "RuntimeEndpoints", "RunningTask", "TaskSink", "openai_error_result",
    "runtime_agent", "runtime_failure", "upstream_root",
]

log = Logger(namespace="infx.runtimes")


class TaskSink(Protocol):
    """Where a runtime reports one task's results."""

    def send(self, result: worker_pb2.TaskResult) -> None:
        """The task's next result."""

    def finish(self) -> None:
        """The task is over (after its last result, or after a failure was reported)."""

    def when_writable(self) -> Deferred[None] | None:
        """None if more results may be sent now; else fires once the stream drained
        (a streaming runtime pauses its upstream meanwhile)."""


class RunningTask(Protocol):
    """A task a runtime is working on."""

    def abort(self) -> None:
        """Stop now; report nothing more."""


class Runtime(Protocol):
    """Something that runs runtime tasks."""

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        """Begin ``task``; results go to ``sink``."""
        ...


def _http_response(status: int, phrase: str | None, body: bytes = b"", headers: dict[str, list[str]] | None = None,
                   latency_ms: int = 0) -> worker_pb2.TaskResult:
    response = worker_pb2.HttpResponse(
        status_code=status, status=status_line(status, phrase), body=body, latency_ms=latency_ms
    )
    for name, values in (headers or {}).items():
        response.header[name].values.extend(values)
    return worker_pb2.TaskResult(http_response=response)


def openai_error_result(error: OpenAIError, latency_ms: int = 0) -> worker_pb2.TaskResult:
    """``error`` as the task's whole answer: its status and OpenAI JSON body (the engine's own
    failures use it too, so it is public)."""
    return _http_response(
        error.status, None, error.to_json(),
        {"Content-Type": ["application/json"]}, latency_ms,
    )


def _event(data: bytes, *, last: bool = False, latency_ms: int = 0) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(
        server_sent_event=worker_pb2.ServerSentEvent(data=data, is_last_event=last, latency_ms=latency_ms)
    )


#: Failures that happen before the request is whole on the wire: the runtime never read it.
_NOT_READ = (ConnectError, DNSLookupError, RequestGenerationFailed, RequestTransmissionFailed, SchemeNotSupported)


def runtime_failure(failure: Failure) -> RuntimeFailure:
    """Whether a request that got no answer may have been read by the runtime: only a failure to
    connect or to write the request says it was not; anything else (the connection closed while
    waiting for the answer, an answer broken off, a failure of a kind not known here) may have
    followed a crash on it, and is reported so."""
    return RuntimeFailure.UNREACHABLE if failure.check(*_NOT_READ) else RuntimeFailure.DROPPED


def describe(failure: Failure) -> str:
    """What a failure of the runtime's connection says, for the log: the wrapped reasons of
    Twisted's ``ResponseFailed`` and kin in words, not as a list of ``Failure`` reprs."""
    reasons = getattr(failure.value, "reasons", None)
    if reasons:
        return "; ".join(f"{type(r.value).__name__}: {r.getErrorMessage()}" for r in reasons)
    return f"{type(failure.value).__name__}: {failure.getErrorMessage()}"


# -- echo -------------------------------------------------------------------------------


class _EchoTask:
    def __init__(self, clock: IReactorTime, task: worker_pb2.Task, sink: TaskSink, config: EchoConfig) -> None:
        self._clock = clock
        self._sink = sink
        self._started = clock.seconds()
        self._schedule = echo_task(task, config, self._started)
        self._next = 0
        self._aborted = False
        self._call: IDelayedCall | None = None
        self._arm()

    def _arm(self) -> None:
        due = self._started + self._schedule[self._next].due
        self._call = self._clock.callLater(max(0.0, due - self._clock.seconds()), self._fire)

    def _fire(self) -> None:
        self._call = None
        now = self._clock.seconds()
        # Results due by now go out together, in order.
        while not self._aborted and self._started + self._schedule[self._next].due <= now:
            self._send(self._schedule[self._next].result)
            self._next += 1
            if self._next == len(self._schedule):
                self._sink.finish()
                return
        if not self._aborted:
            self._arm()

    def _send(self, result: worker_pb2.TaskResult) -> None:
        # protocol.agent.echo marks "data: [DONE]" itself as the last event; LLMariner's
        # engines (and the openai runtime here) relay [DONE] as an ordinary event
        # and end with an empty last event, so the echo runtime does the same.
        event = result.server_sent_event
        if result.WhichOneof("message") == "server_sent_event" and event.is_last_event and event.data:
            self._sink.send(_event(event.data))
            self._sink.send(_event(b"", last=True, latency_ms=int((self._clock.seconds() - self._started) * 1000)))
        else:
            self._sink.send(result)

    def abort(self) -> None:
        self._aborted = True
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


class EchoRuntime:
    """The built-in deterministic runtime (see :mod:`protocol.agent.echo`), timed by ``clock``."""

    def __init__(self, clock: IReactorTime, config: EchoConfig = EchoConfig()) -> None:
        self._clock = clock
        self.config = config

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        return _EchoTask(self._clock, task, sink, self.config)


# -- openai -----------------------------------------------------------------------------

# Headers that describe one hop, or that the agent sets itself, are not forwarded.
_REQUEST_HEADERS_DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "content-type", "accept-encoding",
     "authorization"}
)
# The client's headers that describe the gateway's hop or its credentials, for a verbatim request.
_VERBATIM_HEADERS_DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "authorization", "cookie", "expect"}
)
# An absolute path with its query (no spaces or controls), and an HTTP method, as RFC 9112 allows them.
_REQUEST_TARGET = re.compile(r"/[\x21-\x7e]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: What the ``openai`` runtime announces in ``EngineStatus.infx_capabilities``.
CAPABILITIES = (HTTP_REQUEST_CAPABILITY,)
_RESPONSE_HEADERS_DROPPED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "te", "trailer", "transfer-encoding", "upgrade",
     "content-length"}
)


def upstream_root(url: str) -> str:
    """The server root for ``url``: no trailing slash, no trailing ``/v1``."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _request_body(rr: RuntimeRequest, boundary: Callable[[], str]) -> tuple[str, bytes]:
    if rr.form is not None:
        while True:
            try:
                return rr.form.encode(boundary())
            except OpenAIUsageError:
                continue
    return "application/json", json.dumps(rr.json, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@implementer(IBodyProducer)
class _BytesProducer:
    """A request body already in memory, written in one go (no cooperator, no global reactor)."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class _BodyReader(TwistedProtocol):
    """Reads a whole response body; unlike ``readBody`` it can be aborted on any transport."""

    def __init__(self, whole: Callable[[bytes], None], broken: Callable[[Failure], None]) -> None:
        self._chunks: list[bytes] = []
        self._whole = whole
        self._broken = broken

    def dataReceived(self, data: bytes) -> None:
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        if reason.check(ResponseDone, PotentialDataLoss):
            self._whole(b"".join(self._chunks))
        else:
            self._broken(reason)


class _StreamRelay(TwistedProtocol):
    """Receives a streamed response body and relays its events as they complete.

    A body whose framing ended it (chunked, or a length) ended as the runtime meant; one that
    ended only because the connection closed (no framing, as HTTP/1.0 allows) is whole only if
    its last event is one a stream ends with (:func:`~protocol.openai_observe.ends_stream`),
    else the runtime died mid-stream and the client is told so.
    """

    def __init__(self, call: _OpenAITask) -> None:
        self._call = call
        self._splitter = SSEBlockSplitter(call.runtime.max_event_size)
        self._last_event = b""

    def dataReceived(self, data: bytes) -> None:
        try:
            events = self._splitter.receive_data(data)
        except EventTooLarge as exc:
            self._call.stream_failed(exc.to_event(), exc.message)
            self.transport.stopProducing()
            return
        for event in events:
            self._call.event(event)
        if events:
            self._last_event = events[-1]
        writable = self._call.when_writable()
        if writable is not None and self.transport is not None:
            # The gRPC stream is full: stop reading the runtime until it drains.
            transport = self.transport
            transport.pauseProducing()
            writable.addCallback(lambda _: None if self._call.done else transport.resumeProducing())

    def connectionLost(self, reason: Failure = ResponseDone()) -> None:  # type: ignore[assignment]
        if not reason.check(ResponseDone, PotentialDataLoss):
            self._call.stream_failed(broken_stream_event(), describe(reason))
            return
        rest = self._splitter.end_of_stream()
        if rest is not None:
            self._call.event(rest)
            self._last_event = rest
        if reason.check(PotentialDataLoss) and not ends_stream(self._last_event):
            self._call.stream_failed(broken_stream_event(),
                                     "the connection closed an unframed stream before its final event")
        else:
            self._call.stream_done()


class _OpenAITask:
    def __init__(self, runtime: OpenAIRuntime, task: worker_pb2.Task, sink: TaskSink) -> None:
        self.runtime = runtime
        self._sink = sink
        self._clock = runtime.clock
        self._started = self._clock.seconds()
        # What the gateway's request log names the request by, so that the two logs meet.
        forwarded_id = task.header["x-request-id"].values if "x-request-id" in task.header else ()
        self._request_id = forwarded_id[0] if forwarded_id else task.id
        self._done = False
        self._pending: Deferred[Any] | None = None
        self._body_transport: Any = None
        self._verbatim = task.request.HasField("http_request")
        if self._verbatim:
            verbatim = task.request.http_request
            self._stream = is_streaming(task.request)
            method, path, body = (verbatim.method or "POST"), verbatim.path, bytes(verbatim.body)
            headers = Headers({b"User-Agent": [b"infx-engine"]})
            dropped = _VERBATIM_HEADERS_DROPPED
        else:
            try:
                rr = runtime_request(task.request)
            except OpenAIError as exc:
                self._end_with(openai_error_result(exc))
                return
            self._stream = rr.stream
            content_type, body = _request_body(rr, runtime.boundary)
            method, path = "POST", rr.path
            headers = Headers({b"Content-Type": [content_type.encode("ascii")], b"User-Agent": [b"infx-engine"]})
            dropped = _REQUEST_HEADERS_DROPPED
        for name, value in task.header.items():
            if name.lower() not in dropped:
                headers.setRawHeaders(name.encode("latin-1"), [v.encode("latin-1") for v in value.values])
        if not _REQUEST_TARGET.fullmatch(path) or not _TOKEN.fullmatch(method):
            message = f"The task's request line {method!r} {path!r} is not valid."
            self._end_with(openai_error_result(InvalidRequestError(message)))
            return
        runtime.authorize(headers)
        url = (runtime.root + path).encode("latin-1")
        self._pending = runtime.agent.request(method.encode("latin-1"), url, headers, _BytesProducer(body))
        self._pending.addCallbacks(self._response, self._unreachable)
        self._pending.addErrback(self._bug)

    def _latency(self) -> int:
        return int((self._clock.seconds() - self._started) * 1000)

    def _end_with(self, result: worker_pb2.TaskResult) -> None:
        if self._done:
            return
        self._done = True
        self._sink.send(result)
        self._sink.finish()

    def _unreachable(self, failure: Failure) -> None:
        self._pending = None
        if self._done or failure.check(CancelledError):
            return
        self._runtime_failed(runtime_failure(failure), describe(failure))

    def _runtime_failed(self, failure: RuntimeFailure, detail: str) -> None:
        """The task ends with the agent's answer for ``failure``; ``detail`` goes to the log only."""
        log.info("runtime at {url} failed request {request_id} ({failure}): {detail}", url=self.runtime.root,
                 request_id=self._request_id, failure=failure.value, detail=detail)
        for listener in self.runtime.on_unreachable:
            listener()
        self._end_with(failure_result(failure, self._latency()))

    def _bug(self, failure: Failure) -> None:
        log.failure("openai runtime task failed", failure)
        if not self._done:
            self._end_with(openai_error_result(UpstreamError("The engine failed to relay the runtime's answer.")))

    def _headers(self, response: IResponse) -> dict[str, list[str]]:
        return {
            name.decode("latin-1"): [v.decode("latin-1") for v in values]
            for name, values in response.headers.getAllRawHeaders()
            if name.decode("latin-1").lower() not in _RESPONSE_HEADERS_DROPPED
        }

    def _response(self, response: IResponse) -> Deferred[None] | None:
        self._pending = None
        if self._done:
            return None
        status, phrase = response.code, response.phrase.decode("latin-1")
        if status == 401 and self.runtime.credentials is not None:
            self.runtime.credentials.refused()
        headers = self._headers(response)
        if self._stream and 200 <= status < 300:
            self._sink.send(self._mark(_http_response(status, phrase, headers=headers, latency_ms=self._latency())))
            relay = _StreamRelay(self)
            response.deliverBody(relay)
            self._body_transport = relay.transport
            return None
        latency = self._latency()

        def whole(body: bytes) -> None:
            self._end_with(self._mark(_http_response(status, phrase, body, headers, latency)))

        def broken(reason: Failure) -> None:
            self._runtime_failed(RuntimeFailure.DROPPED, f"its answer ({status}) broke off: {describe(reason)}")

        reader = _BodyReader(whole, broken)
        response.deliverBody(reader)
        self._body_transport = reader.transport
        return None

    def _mark(self, result: worker_pb2.TaskResult) -> worker_pb2.TaskResult:
        """The runtime's own answer to a verbatim request is marked as such for the gateway."""
        result.verbatim_answer = self._verbatim
        return result

    @property
    def done(self) -> bool:
        return self._done

    def when_writable(self) -> Deferred[None] | None:
        return None if self._done else self._sink.when_writable()

    def event(self, data: bytes) -> None:
        if not self._done:
            self._sink.send(_event(data))

    def stream_done(self) -> None:
        if not self._done:
            self._done = True
            self._sink.send(_event(b"", last=True, latency_ms=self._latency()))
            self._sink.finish()

    def stream_failed(self, event: bytes, detail: str) -> None:
        """The stream cannot go on: ``event`` (an error) ends it, with no ``[DONE]``; ``detail`` is logged."""
        if not self._done:
            log.info("runtime at {url} broke off the stream of request {request_id}: {detail}",
                     url=self.runtime.root, request_id=self._request_id, detail=detail)
            self._sink.send(_event(event))
            self.stream_done()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._pending is not None:
            self._pending.cancel()
        elif self._body_transport is not None:
            self._body_transport.stopProducing()


@implementer(IAgentEndpointFactory)
class RuntimeEndpoints:
    """The endpoints an :class:`~twisted.web.client.Agent` dials the runtime with, each built once.

    Twisted's own factory builds a ``HostnameEndpoint`` (an IDNA check of the
    host) and, for HTTPS, a TLS connection creator for every request; the
    runtime is one server, so its endpoint is kept (one per scheme, host and
    port: the upstream URL fixes them) and each request only dials it
    when the pool has no idle connection.
    """

    def __init__(self, reactor: Any, connect_timeout: float | None = None) -> None:
        self._reactor = reactor
        self._connect_timeout = connect_timeout
        self._tls = BrowserLikePolicyForHTTPS()
        self._endpoints: dict[tuple[bytes, bytes, int], IStreamClientEndpoint] = {}

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if uri.scheme not in (b"http", b"https"):
                raise SchemeNotSupported(f"Unsupported scheme: {uri.scheme!r}")
            endpoint = HostnameEndpoint(self._reactor, uri.host.decode("ascii"), uri.port,
                                        timeout=self._connect_timeout)
            if uri.scheme == b"https":
                endpoint = wrapClientTLS(self._tls.creatorForNetloc(uri.host, uri.port), endpoint)
            self._endpoints[key] = endpoint
        return endpoint


def runtime_agent(reactor: Any, pool: HTTPConnectionPool, connect_timeout: float | None = None) -> IAgent:
    """An Agent for the runtime: ``pool``'s persistent connections, :class:`RuntimeEndpoints`' endpoints."""
    return Agent.usingEndpointFactory(reactor, RuntimeEndpoints(reactor, connect_timeout), pool=pool)


class OpenAIRuntime:
    """Forwards tasks to an OpenAI-compatible server (vLLM, Ollama, llama.cpp server, SGLang).

    ``agent`` is a :class:`twisted.web.client.Agent` (give it a persistent
    ``HTTPConnectionPool``); ``upstream`` is the server's base URL (see the
    module docstring about ``/v1``). Failures to reach the server become 503
    (the gateway retries elsewhere); the server's own error statuses,
    headers and bodies are relayed as they are; streamed answers are relayed
    event by event as they arrive, whatever their size up to
    ``max_event_size``. Aborting a task closes its upstream connection, which
    makes the server stop generating. ``credentials``, if given, go out as
    ``Authorization: Bearer`` on every request (the client's own
    ``Authorization`` never does). ``on_unreachable`` listeners hear of every
    request that could not reach the server (the health check then runs at once).
    """

    def __init__(
        self,
        clock: IReactorTime,
        agent: IAgent,
        upstream: str,
        *,
        max_event_size: int | None = DEFAULT_MAX_EVENT_SIZE,
        boundary: Callable[[], str] = lambda: "infx-" + secrets.token_hex(16),
        credentials: UpstreamKey | None = None,
    ) -> None:
        self.clock = clock
        self.agent = agent
        self.root = upstream_root(upstream)
        self.max_event_size = max_event_size
        self.boundary = boundary
        self.credentials = credentials
        self.on_unreachable: list[Callable[[], None]] = []

    def authorize(self, headers: Headers) -> None:
        """Add the runtime's credentials, if any, to a request's ``headers``."""
        if self.credentials is not None:
            headers.setRawHeaders(b"Authorization", [b"Bearer " + self.credentials.current().encode("ascii")])

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        return _OpenAITask(self, task, sink)
