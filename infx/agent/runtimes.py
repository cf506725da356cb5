"""Runtimes the engine agent runs tasks on: the built-in ``echo`` and any ``openai``-compatible server.

A runtime takes a runtime task (chat, embedding, audio, response, tokenize)
and reports its results to a :class:`TaskSink`: the ``HttpResponse`` first,
then, for a streamed answer, one ``ServerSentEvent`` per event and a last
one with ``is_last_event``; then ``finish()``. Task ids and result indexes
are stamped by the agent's core, so a runtime need not set them. A runtime
must stop reporting once aborted (the agent drops stray results anyway).

The ``openai`` runtime sends the request :mod:`protocol.agent.relay` makes of a
task on a kept-alive connection of :mod:`infx.agent.runtime_client`. A task
that carries the client's request verbatim (``TaskRequest.http_request``, see
:mod:`protocol.openai.task_forms`) goes as it is: the client's method, path,
body and headers (but hop-by-hop ones, ``Authorization``, ``Cookie``,
``Content-Length``, ``Host``, ``Accept-Encoding`` and ``Expect``, which belong to
this hop), and its answer is marked ``verbatim_answer`` so that the gateway
relays it unchanged; the runtime announces this with :data:`CAPABILITIES`. A
task with only the typed form (from a gateway that does not know the
capability) is converted by :mod:`protocol.openai.runtime`.

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

import secrets
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from infx.agent.runtime_client import Exchange, RuntimeClient
from infx.agent.upstream_key import UpstreamKey
from protocol.agent.echo import EchoConfig, echo_task
from protocol.agent.relay import answer_headers, relay_request, request_id
from protocol.agent.runtime_failures import RuntimeFailure, broken_stream_event, failure_result
from protocol.openai.errors import OpenAIError, status_line
from protocol.openai.observe import ends_stream
from protocol.openai.sse import DEFAULT_MAX_EVENT_SIZE, EventTooLarge, SSEBlockSplitter
from protocol.openai.task_forms import HTTP_REQUEST_CAPABILITY
from protocol.pb import worker_pb2

__all__ = [
    "CAPABILITIES", "EchoRuntime", "OpenAIRuntime", "Runtime", "RunningTask", "TaskSink", "event_result",
    "openai_error_result", "upstream_root",
]

log = Logger(namespace="infx.runtimes")


class TaskSink(Protocol):
    """Where a runtime reports one task's results."""

    def send(self, result: worker_pb2.TaskResult) -> None:
        """The task's next result."""

    def event(self, data: bytes) -> None:
        """The next whole event of a streamed answer, or of a verbatim one the next whole events that
        came together: the same as ``send`` of its ``ServerSentEvent`` (:func:`event_result`), which a
        sink that hands events on without that message need not build."""

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


def event_result(data: bytes, *, last: bool = False, latency_ms: int = 0) -> worker_pb2.TaskResult:
    """One event of a streamed answer as a result (``last``: the stream's end, with no data)."""
    return worker_pb2.TaskResult(
        server_sent_event=worker_pb2.ServerSentEvent(data=data, is_last_event=last, latency_ms=latency_ms)
    )


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
            self._sink.send(event_result(event.data))
            elapsed_ms = int((self._clock.seconds() - self._started) * 1000)
            self._sink.send(event_result(b"", last=True, latency_ms=elapsed_ms))
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

#: What the ``openai`` runtime announces in ``EngineStatus.infx_capabilities``.
CAPABILITIES = (HTTP_REQUEST_CAPABILITY,)


def upstream_root(url: str) -> str:
    """The server root for ``url``: no trailing slash, no trailing ``/v1``."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


class _OpenAITask:
    """One task relayed to the runtime: the request :mod:`protocol.agent.relay` makes of it, its
    answer turned into results (a :class:`~infx.agent.runtime_client.ResponseHandler`)."""

    def __init__(self, runtime: OpenAIRuntime, task: worker_pb2.Task, sink: TaskSink) -> None:
        self.runtime = runtime
        self._sink = sink
        self._clock = runtime.clock
        self._started = self._clock.seconds()
        self._task = task
        self._done = False
        self._exchange: Exchange | None = None
        self._status = 0
        self._phrase = ""
        self._headers: dict[str, list[str]] = {}
        self._latency = 0
        self._body: list[bytes] = []
        self._splitter: SSEBlockSplitter | None = None
        self._last_event = b""
        try:
            request = relay_request(task, runtime.key(), runtime.boundary)
        except OpenAIError as exc:
            self._end_with(openai_error_result(exc))
            return
        self._stream = request.stream
        self._verbatim = request.verbatim
        self._exchange = runtime.client.request(request.method, runtime.path_prefix + request.target, request.fields,
                                                request.body, self)

    def _elapsed_ms(self) -> int:
        return int((self._clock.seconds() - self._started) * 1000)

    def _end_with(self, result: worker_pb2.TaskResult) -> None:
        if self._done:
            return
        self._done = True
        self._sink.send(result)
        self._sink.finish()

    def _runtime_failed(self, failure: RuntimeFailure, detail: str) -> None:
        """The task ends with the agent's answer for ``failure``; ``detail`` goes to the log only."""
        if self._done:
            return
        log.info("runtime at {url} failed request {request_id} ({failure}): {detail}", url=self.runtime.root,
                 request_id=request_id(self._task), failure=failure.value, detail=detail)
        for listener in self.runtime.on_unreachable:
            listener()
        self._end_with(failure_result(failure, self._elapsed_ms()))

    def _mark(self, result: worker_pb2.TaskResult) -> worker_pb2.TaskResult:
        """The runtime's own answer to a verbatim request is marked as such for the gateway."""
        result.verbatim_answer = self._verbatim
        return result

    # -- the answer (ResponseHandler)

    def response_started(self, status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> None:
        if self._done:
            return
        if status == 401 and self.runtime.credentials is not None:
            self.runtime.credentials.refused()
        self._status, self._phrase = status, reason.decode("latin-1")
        self._headers = answer_headers(fields)
        self._latency = self._elapsed_ms()
        if self._stream and 200 <= status < 300:
            self._splitter = SSEBlockSplitter(self.runtime.max_event_size)
            self._sink.send(self._mark(_http_response(status, self._phrase, headers=self._headers,
                                                      latency_ms=self._latency)))

    def body_received(self, data: bytes) -> None:
        if self._done:
            return
        splitter = self._splitter
        if splitter is None:
            self._body.append(data)
            return
        try:
            events = splitter.receive_data(data)
        except EventTooLarge as exc:
            self._stream_failed(exc.to_event(), exc.message)
            if self._exchange is not None:
                self._exchange.abort()
            return
        if events:
            self._last_event = events[-1]
            if self._verbatim:
                # The runtime's own stream: what one read completes goes on as one piece.
                self._sink.event(b"".join(events))  # a lone event is itself, not a copy
            else:
                for event in events:
                    self._sink.event(event)
        writable = self._sink.when_writable()
        if writable is not None and self._exchange is not None:
            # The results' stream is full: stop reading the runtime until it drains.
            exchange = self._exchange
            exchange.pause()
            writable.addCallback(lambda _: None if self._done else exchange.resume())

    def response_ended(self, framed: bool) -> None:
        if self._done:
            return
        splitter = self._splitter
        if splitter is None:
            self._end_with(self._mark(_http_response(self._status, self._phrase, b"".join(self._body), self._headers,
                                                     self._latency)))
            return
        rest = splitter.end_of_stream()
        if rest is not None:
            self._sink.event(rest)
            self._last_event = rest
        if not framed and not ends_stream(self._last_event):
            self._stream_failed(broken_stream_event(), "the connection closed an unframed stream before its final event")
        else:
            self._stream_done()

    def response_broken(self, detail: str) -> None:
        if self._splitter is not None:
            self._stream_failed(broken_stream_event(), detail)
        else:
            self._runtime_failed(RuntimeFailure.DROPPED, f"its answer ({self._status}) broke off: {detail}")

    def request_failed(self, failure: RuntimeFailure, detail: str) -> None:
        self._runtime_failed(failure, detail)

    def _stream_done(self) -> None:
        if not self._done:
            self._done = True
            self._sink.send(event_result(b"", last=True, latency_ms=self._elapsed_ms()))
            self._sink.finish()

    def _stream_failed(self, event: bytes, detail: str) -> None:
        """The stream cannot go on: ``event`` (an error) ends it, with no ``[DONE]``; ``detail`` is logged."""
        if not self._done:
            log.info("runtime at {url} broke off the stream of request {request_id}: {detail}",
                     url=self.runtime.root, request_id=request_id(self._task), detail=detail)
            self._sink.send(event_result(event))
            self._stream_done()

    # -- RunningTask

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._exchange is not None:
            self._exchange.abort()


class OpenAIRuntime:
    """Forwards tasks to an OpenAI-compatible server (vLLM, Ollama, llama.cpp server, SGLang).

    ``client`` is the :class:`~infx.agent.runtime_client.RuntimeClient` of the
    server at ``upstream`` (see the module docstring about ``/v1``). Failures to
    reach the server become 503 (the gateway retries elsewhere); the server's
    own error statuses, headers and bodies are relayed as they are; streamed
    answers are relayed event by event as they arrive, whatever their size up
    to ``max_event_size``. Aborting a task closes its upstream connection, which
    makes the server stop generating. ``credentials``, if given, go out as
    ``Authorization: Bearer`` on every request (the client's own
    ``Authorization`` never does). ``on_unreachable`` listeners hear of every
    request that could not reach the server (the health check then runs at once).
    """

    def __init__(
        self,
        clock: IReactorTime,
        client: RuntimeClient,
        upstream: str,
        *,
        max_event_size: int | None = DEFAULT_MAX_EVENT_SIZE,
        boundary: Callable[[], str] = lambda: "infx-" + secrets.token_hex(16),
        credentials: UpstreamKey | None = None,
    ) -> None:
        self.clock = clock
        self.client = client
        self.root = upstream_root(upstream)
        #: A server mounted below its host's root (behind a proxy at ``/llama``) is asked there.
        self.path_prefix = urlsplit(self.root).path.encode("ascii")
        self.max_event_size = max_event_size
        self.boundary = boundary
        self.credentials = credentials
        self.on_unreachable: list[Callable[[], None]] = []

    def key(self) -> str | None:
        """The runtime's API key now, or None."""
        return None if self.credentials is None else self.credentials.current()

    def authorize(self, headers: Headers) -> None:
        """Add the runtime's credentials, if any, to a side request's ``headers`` (health, load)."""
        if self.credentials is not None:
            headers.setRawHeaders(b"Authorization", [b"Bearer " + self.credentials.current().encode("ascii")])

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        return _OpenAITask(self, task, sink)
