"""An OTLP/HTTP traces receiver for tests: decodes what exporters send with the official OTLP protobuf.

It stands where an OpenTelemetry collector would: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` body (protobuf, gzip-compressed or not), decoded
with the ``opentelemetry-proto`` package and kept as :class:`ReceivedSpan`
values; anything else is a 404. A real HTTP server on a loopback port, on a
thread of the test's process, so that real ``twistd`` children export to it.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpReceiver", "ReceivedSpan"]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as exported: ids in lower-case hex (``parent_span_id`` empty for a root)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    #: The span's status: 0 unset, 1 ok, 2 error; and its message.
    status_code: int
    status_message: str
    #: The exporting process's resource (``service.name``, ``service.instance.id``...).
    resource: dict[str, Any]

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode(body: bytes) -> list[ReceivedSpan]:
    """The spans of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(),
                    name=span.name, kind=span.kind, attributes=_attributes(span.attributes),
                    status_code=span.status.code, status_message=span.status.message, resource=resource))
    return spans


class OtlpReceiver:
    """Receives exported spans at :attr:`url` until :meth:`stop`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                spans = decode(body)
                with receiver._lock:
                    receiver._spans.extend(spans)
                    receiver.exports += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The traces URL exporters are given (``--otlp-traces-endpoint``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def reset(self) -> None:
        with self._lock:
            self._spans.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
