"""One API request's trace: what the gateway learns as it serves it, ending in one log line and its metrics.

The HTTP handler (:mod:`infx.http.api`) makes a :class:`RequestTrace` per
request and tells it, in small calls, who asked (request id, tenant), for
what (endpoint, model), what came back (the first output token, usage) and
how it ended (status, and for an error its code and what broke); the task
machinery says who served it (:class:`~infx.gateway.tasks.ServedBy`: engine,
gateway, retries, queue wait). :meth:`finish` runs once, whatever the path to
the end, and writes the request's metrics and its structured ``request`` log
line (twisted.logger named fields plus a readable text).

The status logged and counted is the outcome, not only the status line: a
stream that ended with an error event (a runtime that died mid-stream, an
engine lost, vLLM's own stream errors) is logged and counted with that
error's status (502 for a broken stream), although its status line said 200.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.logger import Logger

from infx.gateway.metrics import OTHER_MODEL, GatewayMetrics
from infx.gateway.tasks import ServedBy
from protocol.gateway.recent import RequestRecord
from protocol.openai.errors import error_type_for
from protocol.openai.observe import StreamWatcher, Usage, usage_of_body

__all__ = ["RequestTrace"]

log = Logger(namespace="infx.request_log")


class RequestTrace:
    """Gathers one request's facts; :meth:`finish` logs and counts them exactly once."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str, started_at: float, journal: Any = None) -> None:
        """``journal``: where the ended request is recorded for /admin/status
        (:class:`~infx.gateway.cluster_status.RequestJournal`; None: nowhere)."""
        self.metrics = metrics
        self.journal = journal
        self.endpoint = endpoint
        self.started_at = started_at
        self.request_id = ""
        self.tenant = ""
        #: The model the client named, as logged; the metrics' label is bounded (see :meth:`named`).
        self.model = ""
        self.model_label = OTHER_MODEL
        self.first_token_seconds: float | None = None
        self.usage: Usage | None = None
        #: For an error: its OpenAI code (or type), and what broke, for the log only.
        self.error = ""
        self.detail = ""
        self.finished = False
        self._stream = StreamWatcher()

    def named(self, model: str, served_here: bool) -> None:
        """The request's model; it becomes a label only if engines serve it (or could be started for it)."""
        self.model = model
        self.model_label = model if served_here else OTHER_MODEL

    def body(self, body: bytes) -> None:
        """A whole (non-streaming) answer: its usage, if any."""
        self.usage = usage_of_body(body) or self.usage

    def failed(self, code: str, detail: str = "") -> None:
        """The request ends in an error with this code; ``detail`` (what broke) is for the log only."""
        self.error = code
        self.detail = detail or self.detail

    def error_body(self, body: bytes) -> None:
        """An error answered with this (OpenAI-shaped) body: its code, or its type, names it."""
        if self.error:
            return
        try:
            error = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return
        if isinstance(error, dict):
            name = error.get("code") if isinstance(error.get("code"), str) else error.get("type")
            self.error = name if isinstance(name, str) else ""

    @property
    def stream_failed(self) -> bool:
        """Whether a relayed stream carried an error event (it ends there)."""
        return self._stream.error is not None

    def event(self, now: float, data: bytes) -> None:
        """One relayed stream event: the first that carries output times the first token."""
        if self._stream.feed(data) and self.first_token_seconds is None:
            self.first_token_seconds = now - self.started_at
            self.metrics.child(self.metrics.first_token_seconds, self.endpoint, self._tenant_label,
                               self.model_label).observe(self.first_token_seconds)
        if self._stream.usage is not None:
            self.usage = self._stream.usage

    def finish(self, now: float, status: int, served: ServedBy | None) -> None:
        """The response ended with ``status`` (499: the client went first); later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        stream_error = self._stream.error
        if stream_error is not None and status < 400:
            # The status line said 200; the stream's last event says how it really ended.
            status = stream_error.status
            self.error = self.error or stream_error.code
        if status >= 400 and not self.error:
            self.error = error_type_for(status)
        seconds = now - self.started_at
        labels = (self.endpoint, self._tenant_label, self.model_label, str(status))
        metrics = self.metrics
        metrics.child(metrics.requests, *labels).inc()
        metrics.child(metrics.request_seconds, *labels).observe(seconds)
        by_model = (self._tenant_label, self.model_label)
        if self.usage is not None:
            metrics.child(metrics.input_tokens, *by_model).inc(self.usage.input_tokens)
            metrics.child(metrics.output_tokens, *by_model).inc(self.usage.output_tokens)
        if served is not None and served.retries:
            metrics.child(metrics.request_retries, *by_model).inc(served.retries)
        served = served or ServedBy()
        if self.journal is not None:
            usage = self.usage
            self.journal.ended(RequestRecord(
                request_id=self.request_id, tenant=self.tenant, endpoint=self.endpoint, model=self.model,
                started_at=self.started_at, ended_at=now, status=status, error=self.error, detail=self.detail,
                served_by=served.gateway, engine_id=served.engine_id, retries=served.retries,
                queued_seconds=served.queued_seconds, first_token_seconds=self.first_token_seconds,
                tokens_in=None if usage is None else usage.input_tokens,
                tokens_out=None if usage is None else usage.output_tokens), self.model_label)
        self._log(status, seconds, served)

    @property
    def _tenant_label(self) -> str:
        return self.tenant or "-"

    def _log(self, status: int, seconds: float, served: ServedBy) -> None:
        ttft = "-" if self.first_token_seconds is None else f"{self.first_token_seconds:.3f}s"
        usage = self.usage
        tokens_in = None if usage is None else usage.input_tokens
        tokens_out = None if usage is None else usage.output_tokens
        # The text is rendered here, in one f-string: an observer then formats one field,
        # not fourteen through string.Formatter (the biggest cost of the line). What is
        # unknown reads "-" in the text (and None in the fields).
        text = (f"request {self.request_id} {self.endpoint} model={self.model!r} tenant={self.tenant!r} "
                f"status={status} latency={seconds:.3f}s ttft={ttft} tokens_in={_known(tokens_in)} "
                f"tokens_out={_known(tokens_out)} engine={served.engine_id!r} gateway={served.gateway!r} "
                f"retries={served.retries}")
        if self.error:
            text += f" error={self.error}"
        if self.detail:
            text += f" detail={self.detail!r}"
        log.info(
            "{text}",
            text=text,
            event="request",
            request_id=self.request_id,
            endpoint=self.endpoint,
            model=self.model,
            tenant=self.tenant,
            status=status,
            latency_seconds=seconds,
            ttft=ttft,
            time_to_first_token_seconds=self.first_token_seconds,
            queued_seconds=served.queued_seconds,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            engine_id=served.engine_id,
            gateway=served.gateway,
            retries=served.retries,
            error=self.error or None,
            detail=self.detail or None,
        )


def _known(value: int | None) -> str:
    return "-" if value is None else str(value)
