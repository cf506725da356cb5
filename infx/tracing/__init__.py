"""OpenTelemetry traces of the gateway and the engine agent (docs/tracing.md); off by default.

Importing this package imports no opentelemetry module, so a gateway without
``--otlp-traces-endpoint`` loads none and its request path only checks that its
``tracing`` is None. :func:`start_tracing` imports the SDK and the OTLP exporter
(:mod:`infx.tracing.spans`) once tracing is asked for; :func:`tracing_problem`
says at start, before anything listens, what is wrong with the options, the
``otel`` extra missing among them. Reading and forming ``traceparent`` is pure
(:mod:`protocol.tracing.traceparent`).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from twisted.logger import Logger

if TYPE_CHECKING:
    from infx.tracing.spans import Tracing

__all__ = ["PROTOCOLS", "TracingConfig", "start_tracing", "tracing_problem"]

log = Logger(namespace="infx.tracing")

#: How spans are exported: OTLP over HTTP (protobuf bodies) or over gRPC, as the SDK offers.
PROTOCOLS = ("http/protobuf", "grpc")
#: What must be importable when tracing is on: the ``otel`` extra.
_OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                 "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")


@dataclass(frozen=True)
class TracingConfig:
    """Where and how spans go.

    endpoint: the OTLP receiver's URL: for ``http/protobuf`` the traces URL
        (``http://collector:4318/v1/traces``; a URL with no path gets ``/v1/traces``),
        for ``grpc`` the collector's address (``http://collector:4317``; ``https``: TLS).
    protocol: one of :data:`PROTOCOLS`.
    sample_ratio: share of new traces recorded (0 to 1); a caller's ``traceparent``
        decides for its own trace (its sampled flag), as OpenTelemetry's parent-based sampler does.
    record_content: put the request body and the answer (prompt and completion text) on the
        request's span, cut at :data:`~infx.tracing.spans.MAX_CONTENT_BYTES` each; off, no
        span carries either.
    export_delay: seconds between exports of the spans batched meanwhile.
    """

    endpoint: str
    protocol: str = "http/protobuf"
    sample_ratio: float = 1.0
    record_content: bool = False
    export_delay: float = 1.0


def tracing_problem(endpoint: str | None, protocol: str, sample_ratio: float) -> str | None:
    """What is wrong with these tracing options (one line, naming the option), or None."""
    if protocol not in PROTOCOLS:
        return f"--otlp-traces-protocol: expected one of {', '.join(PROTOCOLS)}, got {protocol!r}"
    if not (math.isfinite(sample_ratio) and 0 <= sample_ratio <= 1):
        return f"--trace-sample-ratio: expected a number from 0 to 1, got {sample_ratio:g}"
    if endpoint is None:
        return None
    parts = urlsplit(endpoint)
    try:
        parts.port
    except ValueError:
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--otlp-traces-endpoint: expected an http(s) URL such as http://collector:4318/v1/traces, got {endpoint!r}"
    missing = [name for name in _OTEL_MODULES if not _importable(name)]
    if missing:
        return ("--otlp-traces-endpoint needs the otel extra: pip install 'infx[otel]' "
                f"(no {missing[0].rsplit('.', 1)[0]} here)")
    return None


def _importable(module: str) -> bool:
    # find_spec imports the parents of ``module`` (opentelemetry.sdk, ...): only called with tracing asked for.
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def start_tracing(config: TracingConfig, service: str, instance: str, reactor: Any,
                  on_lost: Callable[[int], None] = lambda count: None) -> Tracing:
    """The SDK's tracer provider exporting to ``config.endpoint``, as ``service`` (``infx-gateway``,
    ``infx-engine``) instance ``instance``; what is still batched is exported when ``reactor`` has shut down.

    Spans the exporter could not deliver are logged and given to ``on_lost`` (a count), on the reactor."""
    from infx.tracing.spans import Tracing

    def lost(count: int) -> None:
        log.warn("tracing: {count} spans could not be exported to {endpoint} and are lost", count=count,
                 endpoint=config.endpoint, event="trace_spans_lost")
        on_lost(count)

    tracing = Tracing.exporting(config, service, instance, lambda count: reactor.callFromThread(lost, count))
    reactor.addSystemEventTrigger("after", "shutdown", tracing.shutdown)
    return tracing
