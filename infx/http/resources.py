"""The gateway's resource tree: which path serves what, and the answers that need no task.

:func:`build_resource` lays out the tree (mounted by :mod:`infx.http.site` or
:mod:`infx.http.lean`, or inside another Twisted application). The OpenAI
endpoints hand each request to an :class:`~infx.http.api.ApiCall`; the model
list, probes and metrics answer here. Every path refuses a method it does not
take with a JSON 405 naming those it does, and an unknown path with a JSON 404,
through :meth:`~infx.http.api.HttpApi.refuse`, so each refusal is logged and counted.
"""

from __future__ import annotations

import json
from email.parser import BytesParser
from email.policy import HTTP as HTTP_POLICY
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from twisted.logger import Logger
from twisted.web import resource, server

from infx.http.admin import AdminTree
from infx.http.api import (
    UNKNOWN_ENDPOINT, ApiCall, CompletionTransform, HttpApi, Parser, request_header,
)
from protocol.openai import requests as openai_requests
from protocol.openai import verbatim as openai_verbatim
from protocol.openai.errors import InvalidRequestError, ModelNotFoundError

__all__ = ["MetricsSource", "build_resource", "own_metrics_resource"]

log = Logger(namespace="infx.gateway")


class _Route(resource.Resource):
    """A path of the gateway: ``endpoint`` names it in logs and metrics, ``methods`` are those it
    serves (HEAD too where GET is); any other is refused with a JSON 405 and ``Allow``."""

    endpoint = ""
    methods: tuple[bytes, ...] = (b"GET",)

    def __init__(self, gateway: HttpApi) -> None:
        super().__init__()
        self.gateway = gateway

    def render(self, request: server.Request) -> Any:
        method = b"GET" if request.method == b"HEAD" and b"GET" in self.methods else request.method
        if method not in self.methods:
            allowed = self.methods + ((b"HEAD",) if b"GET" in self.methods else ())
            request.setHeader(b"allow", b", ".join(allowed))
            said = f"{request.method.decode('latin-1')[:16]} {_path_of(request)}"
            return self.gateway.refuse(request, self.endpoint, 405, f"Invalid method for URL ({said}); "
                                       f"it takes {', '.join(m.decode() for m in allowed)}.", code="method_not_allowed")
        return getattr(self, "render_" + method.decode("ascii"))(request)


class _Endpoint(_Route):
    """A JSON endpoint: the body travels verbatim, its typed conversion (by ``runtime_path``,
    :data:`~protocol.openai.verbatim.TYPED_BY_PATH`) beside it for LLMariner engines.

    ``kind`` is the typed request kind; ``runtime_path`` the path the runtime
    serves the endpoint at: ``/v1/{name}``, or vLLM's ``/tokenize``.
    """

    isLeaf = True
    methods = (b"POST",)

    def __init__(self, gateway: HttpApi, name: str, kind: str,
                 transform: Callable[[], CompletionTransform] | None = None, runtime_path: str | None = None) -> None:
        super().__init__(gateway)
        self.endpoint = name
        self.kind = kind
        self.transform = transform
        self.runtime_path = runtime_path or f"/v1/{name}"
        self.typed = openai_verbatim.TYPED_BY_PATH[self.runtime_path]

    def render_POST(self, request: server.Request) -> int | bytes:
        call = ApiCall(self.gateway, request, self.endpoint, self.transform() if self.transform else None)
        path = _runtime_uri(request, self.runtime_path)
        return call.start(lambda body, typed_wanted: openai_verbatim.parse_json(
            self.kind, path, body, self.typed, typed_wanted))


def _runtime_uri(request: server.Request, path: str) -> str:
    """``path`` with the client's query string, if it sent one."""
    _, mark, query = request.uri.partition(b"?")
    return path + (mark + query).decode("latin-1")


def _parse_multipart_transcription(request: server.Request) -> Parser:
    """Audio transcriptions arrive as multipart/form-data: fields plus the file and its name."""

    def parse(body: bytes, typed_wanted: Callable[[str], bool]) -> openai_requests.ParsedRequest:
        # A transcription's typed form is always built: its form fields are decoded here anyway.
        content_type = request_header(request, "content-type") or ""
        if not content_type.lower().startswith("multipart/form-data"):
            raise InvalidRequestError("Expected a multipart/form-data body.", param="file")
        message = BytesParser(policy=HTTP_POLICY).parsebytes(
            b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
        )
        if not message.is_multipart():
            raise InvalidRequestError("The multipart body could not be parsed.", param="file")
        fields: dict[str, str] = {}
        file: bytes | None = None
        filename = ""
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if not isinstance(name, str):
                continue
            payload = part.get_payload(decode=True)
            data = payload if isinstance(payload, bytes) else b""
            if name == "file":
                file = data
                filename = part.get_filename() or "audio"
            else:
                fields[name] = data.decode("utf-8", "replace")
        path = _runtime_uri(request, "/v1/audio/transcriptions")
        return openai_verbatim.parse_form(path, body, fields, file, filename)

    return parse


class _Transcriptions(_Route):
    isLeaf = True
    endpoint = "audio/transcriptions"
    methods = (b"POST",)

    def render_POST(self, request: server.Request) -> int | bytes:
        return ApiCall(self.gateway, request, self.endpoint).start(_parse_multipart_transcription(request))


class _Models(_Route):
    endpoint = "models"

    def getChild(self, path: bytes, request: server.Request) -> resource.Resource:
        if not path:
            return self
        return _Model(self.gateway, path.decode("utf-8", "replace"))

    def render_GET(self, request: server.Request) -> bytes:
        principal = self.gateway.keys.client(request_header(request, "authorization"))
        if principal is None:
            return self.gateway.refuse(request, self.endpoint, 401, "Missing or unknown API key.",
                                       code="invalid_api_key")
        request.setHeader("content-type", "application/json")
        models = self.gateway.runner.models(principal.tenant)
        return json.dumps({"object": "list", "data": [_model_object(m) for m in models]}).encode()


class _Model(_Route):
    isLeaf = True
    endpoint = "models"

    def __init__(self, gateway: HttpApi, model: str) -> None:
        super().__init__(gateway)
        self.model = model

    def render_GET(self, request: server.Request) -> bytes:
        principal = self.gateway.keys.client(request_header(request, "authorization"))
        if principal is None:
            return self.gateway.refuse(request, self.endpoint, 401, "Missing or unknown API key.",
                                       code="invalid_api_key")
        if self.model not in self.gateway.runner.models(principal.tenant):
            unknown = ModelNotFoundError(self.model)
            return self.gateway.refuse(request, self.endpoint, unknown.status, unknown.message, code=unknown.code,
                                       param=unknown.param, tenant=principal.tenant)
        request.setHeader("content-type", "application/json")
        return json.dumps(_model_object(self.model)).encode()


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "infx"}


class _Health(_Route):
    """A probe: plain ``ok`` while ``check`` holds; else 503 in OpenAI's error shape."""

    isLeaf = True

    def __init__(self, gateway: HttpApi, endpoint: str, check: Callable[[], bool]) -> None:
        super().__init__(gateway)
        self.endpoint = endpoint
        self.check = check

    def render_GET(self, request: server.Request) -> bytes:
        if self.check():
            request.setHeader("content-type", "text/plain")
            return b"ok\n"
        return self.gateway.refuse(request, self.endpoint, 503, "Not ready.", code="not_ready", record=False)


class _Metrics(_Route):
    """This gateway's registry; or, given ``source`` (a worker's), what it gives: every worker's."""

    isLeaf = True
    endpoint = "metrics"

    def __init__(self, gateway: HttpApi, source: MetricsSource | None = None) -> None:
        super().__init__(gateway)
        self.source = source

    def render_GET(self, request: server.Request) -> bytes | int:
        request.setHeader("content-type", CONTENT_TYPE_LATEST)
        if self.source is None:
            return generate_latest(self.gateway.metrics.registry)
        gathered = self.source()

        def write(text: bytes) -> None:
            if not request.finished and not request._disconnected:
                request.write(text)
                request.finish()

        def failed(reason: Any) -> None:
            log.failure("metrics of every worker", reason)
            write(generate_latest(self.gateway.metrics.registry))

        gathered.addCallbacks(write, failed)
        return server.NOT_DONE_YET


#: Gives the exposition text of ``/metrics`` (see :mod:`infx.supervisor.metrics`).
MetricsSource = Callable[[], Any]


class _OwnMetrics(resource.Resource):
    """One registry's metrics, on a port of their own (a worker's private port, see
    :mod:`infx.supervisor.metrics`)."""

    isLeaf = True

    def __init__(self, registry: Any) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: server.Request) -> bytes:
        request.setHeader("content-type", CONTENT_TYPE_LATEST)
        return generate_latest(self.registry)


def own_metrics_resource(registry: Any) -> resource.Resource:
    """``registry``'s metrics at every path, for a port that serves nothing else."""
    return _OwnMetrics(registry)


class _NotFound(_Route):
    """Any method on a path the gateway does not serve: an OpenAI-style 404."""

    isLeaf = True
    endpoint = UNKNOWN_ENDPOINT

    def render(self, request: server.Request) -> bytes:
        return self.gateway.refuse(request, self.endpoint, 404, f"Unknown path {_path_of(request)}.",
                                   code="unknown_url")


class _Tree(_NotFound):
    """A directory: itself and its unknown children answer with an OpenAI-style 404."""

    isLeaf = False

    def getChild(self, path: bytes, request: server.Request) -> resource.Resource:
        return _NotFound(self.gateway)


def _path_of(request: server.Request) -> str:
    """The request's path for a message: as sent, cut short if long."""
    path = request.path.decode("latin-1")
    return path if len(path) <= 200 else path[:200] + "..."


def build_resource(gateway: HttpApi, metrics: MetricsSource | None = None) -> resource.Resource:
    """The gateway's resource tree, to serve with :class:`~infx.http.site.GatewaySite` or mount elsewhere;
    ``metrics`` serves ``/metrics`` in place of this gateway's own registry (a worker's: every worker's)."""
    root = _Tree(gateway)
    v1 = _Tree(gateway)
    root.putChild(b"v1", v1)
    chat = _Tree(gateway)
    v1.putChild(b"chat", chat)
    chat.putChild(b"completions", _Endpoint(gateway, "chat/completions", "chat_completion"))
    v1.putChild(b"completions", _Endpoint(gateway, "completions", "chat_completion", CompletionTransform))
    v1.putChild(b"embeddings", _Endpoint(gateway, "embeddings", "embedding"))
    v1.putChild(b"responses", _Endpoint(gateway, "responses", "model_response"))
    # vLLM serves /tokenize at its root, not under /v1.
    v1.putChild(b"tokenize", _Endpoint(gateway, "tokenize", "tokenize_request", runtime_path="/tokenize"))
    audio = _Tree(gateway)
    v1.putChild(b"audio", audio)
    audio.putChild(b"transcriptions", _Transcriptions(gateway))
    v1.putChild(b"models", _Models(gateway))
    root.putChild(b"healthz", _Health(gateway, "healthz", lambda: True))
    root.putChild(b"readyz", _Health(gateway, "readyz", lambda: gateway.ready))
    root.putChild(b"metrics", _Metrics(gateway, metrics))
    root.putChild(b"admin", AdminTree(gateway))
    return root
