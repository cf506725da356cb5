"""The OpenAI-compatible HTTP API: one API call's whole life, from request to exactly one response.

Each API request becomes one task through a :class:`~infx.gateway.tasks.TaskRunner`
and ends in exactly one response: the engine's answer, relayed (SSE events
verbatim, flushed one by one), or an OpenAI-style error with the status that
names what went wrong. Which path serves what is :mod:`infx.http.resources`'
tree; the sites that serve it, refusing oversized bodies early, are
:mod:`infx.http.site`'s and :mod:`infx.http.lean`'s.

The task carries the client's request verbatim (:mod:`protocol.openai.verbatim`)
beside its typed form, at the endpoint's own API path (wherever the tree is
mounted) with the client's query string. An answer marked ``verbatim`` (the
runtime's own, from infx's engine agent) reaches the client unchanged:
status, reason, headers but hop-by-hop ones, body, events, and no ``[DONE]``
of the gateway's. Answers of LLMariner engines are relayed as before (error
bodies in OpenAI's shape, chat answers to ``/v1/completions`` converted back,
``[DONE]`` ending every chat or completions stream).

Every answer the gateway makes itself is JSON in OpenAI's error shape with the
registered reason phrase (``429 Too Many Requests``, not Twisted's ``Unknown
Status``), on every path and method: a method a path does not take is a 405
naming those it does (``Allow``), an unknown path a 404, a failure inside a
handler a 500 (the traceback goes to the log). Every refusal is logged as a
request line and counted in ``infx_http_requests_total``.

Size (over 600 lines): the API's shared state and one call's whole life (:class:`ApiCall`:
admission, relay, back-pressure, exactly one response) with the request and status helpers they use.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from typing import Any, Callable

from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.web import resource, server
from zope.interface import implementer

from infx.gateway.auth import KeyStore, Principal
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Availability, Submission, TaskHandle, TaskRunner
from infx.http.request_log import RequestTrace
from infx.http.site import DEFAULT_MAX_BODY_SIZE
from protocol.gateway.ratelimit import RateLimiter
from protocol.openai import completions as openai_completions
from protocol.openai import requests as openai_requests
from protocol.openai.errors import (
    ModelNotFoundError, OpenAIError, error_event, error_json, error_type_for, reason_phrase,
)
from protocol.openai.sse import DONE_EVENT, EventReceived, SSEParser, encode_event, ends_with_done
from protocol.pb import worker_pb2
from protocol.processor.fair_queue import CriticalityRefused, requested_criticality
from protocol.routing import hints as routing_hints

log = Logger(namespace="infx.gateway")

#: Hop-by-hop and credential headers never travel to engines.
NOT_FORWARDED = frozenset(
    {
        "authorization", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length", "cookie",
    }
)
#: Headers of the runtime's answer that describe the agent's hop, not the answer.
NOT_RELAYED = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade", "content-length"}
)
#: APIs whose streams end with DONE_EVENT (the Responses API's never do), so that one
#: missing from a LLMariner engine's stream is added.
DONE_ENDPOINTS = frozenset({"chat/completions", "completions"})
#: Seconds a client is told to wait when a model's engines have all gone away.
GONE_RETRY_AFTER = 5
#: A request's own criticality (critical, standard, sheddable): it may lower its key's.
CRITICALITY_HEADER = "x-infx-criticality"


class HttpApi:
    """Shared state of the HTTP API: the runner, keys, limits, metrics, readiness."""

    def __init__(
        self,
        runner: TaskRunner,
        clock: IReactorTime,
        metrics: GatewayMetrics,
        keys: KeyStore | None = None,
        max_buffered_bytes: int = 4 * 1024 * 1024,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        hints: routing_hints.HintsConfig | None = routing_hints.HintsConfig(),
    ) -> None:
        self.runner = runner
        #: How prompts are cut into prefix blocks for routing; None: the routing policy reads no hints.
        self.hints = hints
        self.clock = clock
        self.metrics = metrics
        self.keys = keys or KeyStore.disabled()
        self.limiter = RateLimiter()
        self.max_buffered_bytes = max_buffered_bytes
        #: Checked again when a request is handled, for a site that is not a GatewaySite.
        self.max_body_size = max_body_size
        self.listening = False
        self.shutting_down = False
        self.active_calls: set[ApiCall] = set()
        #: Where each request that ends is recorded for /admin/status (None: nowhere).
        self.journal: Any = None
        #: Builds the /admin/status document (:class:`~infx.gateway.cluster_status.ClusterStatus`);
        #: None: the runner's own dump.
        self.cluster_status: Any = None
        #: The tracer when tracing is on (:class:`infx.tracing.spans.Tracing`): a span per API request.
        self.tracing: Any = None

    @property
    def ready(self) -> bool:
        return self.listening and not self.shutting_down

    def refuse(self, request: server.Request, endpoint: str, status: int, message: str, *, code: str | None = None,
               param: str | None = None, tenant: str = "", record: bool = True) -> bytes:
        """Answer with an error of the gateway's own (not a task's), in OpenAI's shape, with the
        registered reason phrase; unless told not to (a probe's answer), log it as a request and
        count it. Returns the body for ``render`` to return."""
        body = error_json(status, message, code=code, param=param)
        _set_status(request, status)
        request.setHeader("content-type", "application/json")
        request_id = request_header(request, "x-request-id") or new_request_id()
        request.setHeader("x-request-id", request_id)
        if record:
            self.record_refusal(endpoint, request_id, status, code or error_type_for(status), tenant)
        return body

    def refused_early(self, path: bytes, status: int, code: str, detail: str = "") -> None:
        """A refusal the site made before any resource ran (a body over the limit, a handler's
        crash): logged and counted like the others, under the endpoint its path names."""
        self.record_refusal(endpoint_of(path), new_request_id(), status, code, detail=detail)

    def record_refusal(self, endpoint: str, request_id: str, status: int, code: str, tenant: str = "",
                       detail: str = "") -> None:
        """One refused request's log line and metrics (see :class:`~infx.request_log.RequestTrace`)."""
        now = self.clock.seconds()
        trace = RequestTrace(self.metrics, endpoint, now, self.journal)
        trace.request_id = request_id
        trace.tenant = tenant
        trace.failed(code, detail)
        trace.finish(now, status, None)


# --- the API handlers ---------------------------------------------------------

#: An endpoint's request parser, given the body and whether a model's engines may want the typed form.
Parser = Callable[[bytes, Callable[[str], bool]], openai_requests.ParsedRequest]


@implementer(IPushProducer)
class ApiCall:
    """One API request from arrival to its single response; also the task's result sink.

    Streaming responses honour the client's TCP backpressure: while the
    connection is paused, events wait in a bounded buffer; a client that
    falls more than ``max_buffered_bytes`` behind is cut off alone.
    """

    def __init__(self, gateway: HttpApi, request: server.Request, endpoint: str,
                 transform: CompletionTransform | None = None) -> None:
        self.gateway = gateway
        self.request = request
        self.endpoint = endpoint
        self.model = ""
        self.started_at = gateway.clock.seconds()
        self.trace = RequestTrace(gateway.metrics, endpoint, self.started_at, gateway.journal)
        self.transform = transform
        self.handle: TaskHandle | None = None
        self.streaming = False
        self.sse_started = False
        self.done_sent = False
        self.finished = False
        self.paused = False
        #: Made when first needed: most streams never wait for their client (an empty deque is 600 B).
        self.pending: deque[bytes] | None = None
        self.pending_bytes = 0
        #: The status to end with once a paused client has taken what is buffered.
        self._end_pending: int | None = None
        self.status = 200
        self.submitted = False
        #: The answer is the runtime's own (see the module docstring): relay it unchanged.
        self.verbatim = False
        #: This request's span when tracing is on (:class:`infx.tracing.spans.RequestSpan`).
        self.span: Any = None

    # -- request side

    def start(self, parse: Parser) -> int | bytes:
        request = self.request
        request_id = request_header(request, "x-request-id") or new_request_id()
        request.setHeader("x-request-id", request_id)
        self.trace.request_id = request_id
        if self.gateway.tracing is not None:
            self.span = self.gateway.tracing.request_started(_trace_headers(request), self.endpoint, request_id)
        # A GatewaySite refuses an oversized body before it gets here; another site
        # (the resource mounted in a plain twisted.web Site) has buffered it whole.
        if _body_size(request) > self.gateway.max_body_size:
            return self._refuse(413, "The request body is larger than this gateway accepts.", code="request_too_large")
        principal = self._authenticate()
        if principal is None:
            return self._refuse(401, "Missing or unknown API key.", code="invalid_api_key")
        self.trace.tenant = principal.tenant
        body = request.content.read() if request.content else b""
        if request.content is not None:
            # The body lives on in the task (and, once the answer streams, not even there):
            # the request's own copy is not held for the stream's lifetime.
            request.content.close()
            request.content = None
        try:
            criticality = requested_criticality(principal.criticality, principal.admin,
                                                request_header(request, CRITICALITY_HEADER))
        except CriticalityRefused as e:
            return self._refuse(400, f"{CRITICALITY_HEADER}: {e}", code="invalid_criticality")
        runner, tenant = self.gateway.runner, principal.tenant
        try:
            parsed = parse(body, lambda model: runner.typed_form_wanted(tenant, model))
        except OpenAIError as e:
            return self._finish_error(e.status, e.to_json())
        self.model = parsed.model
        self.streaming = parsed.stream
        availability = self.gateway.runner.availability(principal.tenant, parsed.model)
        self.trace.named(parsed.model, availability is not Availability.UNKNOWN)
        if (parsed.typed_error is not None and availability is Availability.SERVED
                and not self.gateway.runner.takes_http_request(principal.tenant, parsed.model)):
            # Only LLMariner engines serve the model, and the request has no typed form for them.
            return self._finish_error(parsed.typed_error.status, parsed.typed_error.to_json())
        if availability is Availability.UNKNOWN:
            unknown = ModelNotFoundError(parsed.model)
            return self._finish_error(unknown.status, unknown.to_json())
        if availability is Availability.GONE:
            self.request.setHeader("retry-after", str(GONE_RETRY_AFTER))
            return self._refuse(
                503, f"No engine serves the model '{parsed.model}' right now; retry later.",
                code="model_unavailable", param="model",
            )
        # Limited after the body is read, so that a refusal is counted under the model it asked for.
        if not self._admit(principal):
            return self._refuse(429, "Rate limit reached for this API key; retry later.", code="rate_limit_exceeded")
        submission_headers = _forwarded_headers(request, request_id)
        submission = Submission(
            tenant=principal.tenant,
            model=parsed.model,
            request=parsed.request,
            streaming=parsed.stream,
            headers=submission_headers,
            timeout=_client_timeout(request),
            request_id=request_id,
            criticality=criticality,
            flow=principal.key_id,
            weight=principal.weight,
            routing_hints=None if self.gateway.hints is None else routing_hints.hints_from_json(
                self.endpoint, body if parsed.body_json is None else parsed.body_json, submission_headers,
                self.gateway.hints),
            trace=self.span,
        )
        if self.span is not None:
            self.span.submitted(submission_headers, parsed.model, principal.tenant, body)
        self.gateway.active_calls.add(self)
        when_done = getattr(request, "call_when_done", None)
        if when_done is not None:
            when_done(self._connection_done)  # the lean server: no Deferred per request
        else:
            request.notifyFinish().addBoth(self._connection_done)
        # From here on an answer is written to the request, even one the
        # runner gives synchronously inside submit() (a deadline already past,
        # a full queue), before it has returned the handle.
        self.submitted = True
        self.handle = self.gateway.runner.submit(submission, self)
        return server.NOT_DONE_YET

    def _authenticate(self) -> Principal | None:
        return self.gateway.keys.client(request_header(self.request, "authorization"))

    def _admit(self, principal: Principal) -> bool:
        decision = self.gateway.limiter.take(principal.key_id, principal.rate_limit, self.gateway.clock.seconds())
        if decision is None:
            return True
        request = self.request
        request.setHeader("x-ratelimit-limit-requests", str(decision.limit))
        request.setHeader("x-ratelimit-remaining-requests", str(decision.remaining))
        request.setHeader("x-ratelimit-reset-requests", f"{decision.reset_after:.3f}s")
        if not decision.allowed:
            request.setHeader("retry-after", str(max(1, math.ceil(decision.retry_after))))
        return decision.allowed

    def _connection_done(self, reason: object) -> None:
        """The response was finished or the client went away; a task still running is cancelled.

        A client that leaves once the stream's ``[DONE]`` reached it (the openai client does, at
        once) had the whole answer, whatever came after: that is a 200, not a 499."""
        self.gateway.active_calls.discard(self)
        if not self.finished:
            self.finished = True
            if self.handle is not None:
                self.handle.cancel()
            if self.done_sent and not self.pending:
                self._record(200)
            else:
                self.trace.failed("client_closed_request")
                self._record(499)

    # -- result sink (see infx.gateway.tasks.ResultSink)

    def response_received(self, response: worker_pb2.HttpResponse, verbatim: bool = False) -> None:
        if self.finished:
            return
        status = response.status_code or 200
        if not 200 <= status <= 599:
            # Not a final HTTP status (1xx, or not one at all): never relay it as the status line.
            self._finish_error(502, error_json(502, f"The engine answered with HTTP status {status}, which is not a "
                                                    "final status.", error_type="upstream_error", code="bad_status"))
            return
        if verbatim:
            self._relay_verbatim(status, response)
            return
        if status != 200:
            self._finish_error(status, _as_openai_error(status, bytes(response.body)))
            return
        if not self.streaming:
            body = bytes(response.body)
            self.trace.body(body)
            if self.span is not None:
                self.span.answered(body)
            if self.transform is not None:
                try:
                    body = self.transform.whole(body)
                except OpenAIError as e:
                    self._finish_error(e.status, e.to_json())
                    return
            _set_status(self.request, 200)
            self.request.setHeader("content-type", _first(response, "content-type") or "application/json")
            self.request.write(body)
            return
        self.sse_started = True
        _set_status(self.request, 200)
        self.request.setHeader("content-type", "text/event-stream")
        self.request.setHeader("cache-control", "no-cache")
        self.request.setHeader("x-accel-buffering", "no")
        self.request.registerProducer(self, True)

    def _relay_verbatim(self, status: int, response: worker_pb2.HttpResponse) -> None:
        """The runtime's status line, headers and body (or the start of its stream), as they came."""
        self.verbatim = True
        request = self.request
        phrase = response.status.split(" ", 1)[1] if " " in response.status else ""
        _set_status(request, status, phrase)
        request.defaultContentType = None  # no content type the runtime did not send
        for name, header in response.header.items():
            if name.lower() not in NOT_RELAYED:
                request.responseHeaders.setRawHeaders(name, [v.encode("latin-1") for v in header.values])
        if self.streaming and 200 <= status < 300:
            self.sse_started = True
            request.registerProducer(self, True)
            return
        body = bytes(response.body)
        if status >= 400:
            self.trace.error_body(body)
        if self.span is not None:
            self.span.answered(body)
            if status >= 400:
                self.span.error_body(body)
        request.setHeader("content-length", str(len(body)))
        request.write(body)
        self._end(status)

    def event_received(self, data: bytes) -> None:
        if self.finished or not self.sse_started:
            return
        self._seen(data)
        if self.transform is not None and not self.verbatim:
            try:
                data = self.transform.event(data)
            except OpenAIError as e:
                self.failed(e.status, e.message, None, code=e.code or "bad_event")
                if self.handle is not None:
                    self.handle.cancel()
                return
            if not data:
                self._consumed(1)
                return
        if ends_with_done(data):
            self.done_sent = True
        self._write_event(data)

    def event_spliced(self, data: bytes) -> bool:
        if self.finished or self.paused or self.pending or not (self.sse_started and self.verbatim):
            return False
        self._seen(data)
        if ends_with_done(data):
            self.done_sent = True
        self.request.write(data)
        return True

    def _seen(self, data: bytes) -> None:
        """An event of the answer, for the request log and the request's span."""
        self.trace.event(self.gateway.clock.seconds(), data)
        if self.span is not None:
            self.span.answered(data)

    def completed(self) -> None:
        if self.finished:
            return
        if (self.sse_started and not self.done_sent and not self.verbatim and self.endpoint in DONE_ENDPOINTS
                and not self.trace.stream_failed):
            # A LLMariner engine's stream gets the [DONE] it lacks, unless it ended in an error.
            self._write_event(DONE_EVENT)
            self.done_sent = True
        self._end(200)

    def failed(self, status: int, message: str, retry_after: float | None, code: str | None = None,
               detail: str = "") -> None:
        if self.finished:
            return
        if status == ModelNotFoundError.status:
            # A task fails 404 only when no engine serves its model after all (start-up learning
            # ended without a peer listing it, the scaler has no deployment for it): the same
            # answer as an unknown model refused at once.
            unknown = ModelNotFoundError(self.model, message)
            body, event = unknown.to_json(), unknown.to_event()
            code = unknown.code
        else:
            body, event = error_json(status, message, code=code), error_event(status, message, code=code)
        self.trace.failed(code or error_type_for(status), detail)
        if self.span is not None:
            self.span.failed(message)
        if self.sse_started:
            # The status line is gone: the error travels as the stream's last event.
            self._write_event(event)
            self._end(status)
            return
        if retry_after is not None:
            self.request.setHeader("retry-after", str(max(1, math.ceil(retry_after))))
        self._finish_error(status, body)

    # -- backpressure (IPushProducer, registered on the HTTP channel)

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        while self.pending and not self.paused and not self.finished:
            data = self.pending.popleft()
            self.pending_bytes -= len(data)
            self.request.write(data)
            self._consumed(1)
        if not self.pending and not self.finished and self._end_pending is not None:
            status, self._end_pending = self._end_pending, None
            self._end(status)

    def stopProducing(self) -> None:
        self.pending = None
        self.pending_bytes = 0

    def _write_event(self, data: bytes) -> None:
        if not self.paused and not self.pending:
            self.request.write(data)
            self._consumed(1)
            return
        if self.pending is None:
            self.pending = deque()
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes > self.gateway.max_buffered_bytes:
            self._cut_off_slow_client()

    def _cut_off_slow_client(self) -> None:
        log.warn("client of {endpoint} read too slowly; its stream is cut off", endpoint=self.endpoint)
        self.gateway.metrics.slow_clients.inc()
        self.pending = None
        self.pending_bytes = 0
        self.finished = True
        if self.handle is not None:
            self.handle.cancel()
        self.trace.failed("slow_client", f"the client fell {self.gateway.max_buffered_bytes} bytes behind")
        self._record(499)
        transport = getattr(self.request.channel, "transport", None)
        if transport is not None:
            transport.abortConnection()

    def _consumed(self, count: int) -> None:
        if self.handle is not None:
            self.handle.consumed(count)

    # -- endings

    def _end(self, status: int) -> None:
        if self.pending:
            # Wait for the paused client to take what is buffered before ending.
            self._end_pending = status
            return
        self.finished = True
        self.gateway.active_calls.discard(self)
        if self.sse_started:
            self.request.unregisterProducer()
        self._record(status)
        if not self.request.finished and not self.request._disconnected:
            self.request.finish()

    def _refuse(self, status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
        self.finished = True
        return self._respond_now(status, error_json(status, message, code=code, param=param))

    def _finish_error(self, status: int, body: bytes) -> int | bytes:
        self.trace.error_body(body)
        if self.span is not None:
            self.span.error_body(body)
        if not self.submitted:
            self.finished = True
            return self._respond_now(status, body)
        _set_status(self.request, status)
        self.request.setHeader("content-type", "application/json")
        self.request.write(body)
        self._end(status)
        return server.NOT_DONE_YET

    def _respond_now(self, status: int, body: bytes) -> bytes:
        self.trace.error_body(body)
        if self.span is not None:
            self.span.error_body(body)
        _set_status(self.request, status)
        self.request.setHeader("content-type", "application/json")
        self._record(status)
        return body

    def _record(self, status: int) -> None:
        self.status = status
        outcome = self.trace.finish(self.gateway.clock.seconds(), status,
                                    self.handle.served_by if self.handle else None)
        if self.span is not None and outcome is not None:
            self.span.finish(outcome, self.trace.error)


class CompletionTransform:
    """Rewrites a LLMariner engine's chat answers as legacy ``text_completion`` answers.

    ``/v1/completions`` travels to LLMariner engines as a chat completion (their
    wire has no completion request), so each of their answers is converted on
    the way back; an infx engine's verbatim answer is the runtime's own
    ``/v1/completions`` answer and is not touched.
    """

    def __init__(self) -> None:
        self._parser = SSEParser()

    def whole(self, body: bytes) -> bytes:
        return openai_completions.text_completion_body(body)

    def event(self, data: bytes) -> bytes:
        out = []
        for event in self._parser.receive_data(data):
            if isinstance(event, EventReceived):
                converted = openai_completions.text_completion_event_data(event.data.encode("utf-8"))
                out.append(encode_event(converted))
        return b"".join(out)



# --- helpers ------------------------------------------------------------------

#: The endpoint label of a path the gateway does not serve.
UNKNOWN_ENDPOINT = "unknown"
#: The endpoint each path of :func:`build_resource`'s tree is logged and counted as, for refusals
#: made before the tree is reached (:meth:`HttpApi.refused_early`).
ENDPOINTS = {
    b"/v1/chat/completions": "chat/completions", b"/v1/completions": "completions",
    b"/v1/embeddings": "embeddings", b"/v1/responses": "responses", b"/v1/tokenize": "tokenize",
    b"/v1/audio/transcriptions": "audio/transcriptions", b"/v1/models": "models", b"/healthz": "healthz",
    b"/readyz": "readyz", b"/metrics": "metrics", b"/admin/status": "admin/status",
    b"/admin/events": "admin/events",
}


#: The bits of a random (version 4, RFC 9562 variant) UUID that are not random.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def new_request_id() -> str:
    """A request's id when its client sent none: ``uuid.uuid4().hex``, the same 122 random bits
    in the same form, without building a ``UUID`` (its checks were 1 % of a request by URL)."""
    return "%032x" % (int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET)


def endpoint_of(path: bytes) -> str:
    """The endpoint label of a request path (its query dropped); :data:`UNKNOWN_ENDPOINT` for others."""
    path = path.split(b"?", 1)[0].rstrip(b"/")
    if path.startswith(b"/v1/models/"):
        return "models"
    return ENDPOINTS.get(path, UNKNOWN_ENDPOINT)


def _set_status(request: server.Request, status: int, phrase: str = "") -> None:
    """The status line with ``phrase``, else the registered one (Twisted's own table lacks some,
    429 among them, and would say ``Unknown Status``)."""
    reason = phrase or reason_phrase(status)
    request.setResponseCode(status, reason.encode("latin-1", "replace") if reason else None)



def _body_size(request: server.Request) -> int:
    content = request.content
    if content is None:
        return 0
    position = content.tell()
    size = content.seek(0, 2)
    content.seek(position)
    return int(size)


def request_header(request: server.Request, name: str) -> str | None:
    # Asked by bytes name, Twisted returns the raw bytes; by str name it decodes
    # them as UTF-8 and a client's non-UTF-8 header would raise (a 500).
    value = request.getHeader(name.encode("ascii"))
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _trace_headers(request: server.Request) -> dict[str, list[str]]:
    """The caller's trace context headers, as the tracer reads them."""
    return {name: [v.decode("latin-1") for v in request.requestHeaders.getRawHeaders(name.encode(), [])]
            for name in ("traceparent", "tracestate")}


def _forwarded_headers(request: server.Request, request_id: str) -> dict[str, list[str]]:
    headers: dict[str, list[str]] = {}
    pairs = getattr(request, "header_pairs", None)
    if pairs is not None:
        # The lean server's fields as parsed: grouped by name in the order names first appear, as
        # Headers.getAllRawHeaders gives them, without building Headers. A value with a line
        # break (which Headers rewrites) takes Headers' own path.
        for raw_name, raw_value in pairs:
            if b"\r" in raw_value or b"\n" in raw_value:
                headers.clear()
                break
            name = raw_name.decode("latin-1").lower()
            if name in NOT_FORWARDED or name == "x-request-id":
                continue
            values = headers.get(name)
            if values is None:
                headers[name] = [raw_value.decode("latin-1")]
            else:
                values.append(raw_value.decode("latin-1"))
        else:
            headers["x-request-id"] = [request_id]
            return headers
    for raw_name, raw_values in request.requestHeaders.getAllRawHeaders():
        name = raw_name.decode("latin-1").lower()
        if name in NOT_FORWARDED or name == "x-request-id":
            continue
        headers[name] = [v.decode("latin-1") for v in raw_values]
    headers["x-request-id"] = [request_id]
    return headers


def _client_timeout(request: server.Request) -> float | None:
    """The client's own timeout: ``x-request-timeout`` or the OpenAI SDK's ``x-stainless-timeout``."""
    for name in ("x-request-timeout", "x-stainless-timeout"):
        value = request_header(request, name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    return None


def _first(response: worker_pb2.HttpResponse, name: str) -> str | None:
    for key, value in response.header.items():
        if key.lower() == name and value.values:
            return str(value.values[0])
    return None


def _as_openai_error(status: int, body: bytes) -> bytes:
    """The engine's error body if it already has OpenAI's shape, else one wrapped around it."""
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return body
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            return error_json(status, parsed["message"])
    except ValueError:
        pass
    text = body.decode("utf-8", "replace").strip() or (reason_phrase(status) or "error")
    return error_json(status, text[:2000])
