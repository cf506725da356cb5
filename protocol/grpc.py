"""gRPC over HTTP/2, client and server roles, as a sans-IO state machine.

Rules this file keeps: no sockets, no threads, no reactor, no clock reads.
Bytes go in through :meth:`GrpcConnection.receive_data`, events come out as
frozen dataclasses (``protocol/grpc_types.py``), bytes to write come out of
:meth:`GrpcConnection.data_to_send`; commands are methods.  Time is the
``now`` argument (any monotonic float, in seconds); the machine says when it
must be woken through :meth:`GrpcConnection.next_deadline` and the caller
then calls :meth:`GrpcConnection.handle_timeout`.  The machine moves message
*bytes*: (de)serialisation belongs to the caller.

Local misuse (a command that is not allowed now) raises
:class:`LocalProtocolError`; a peer that breaks the protocol never raises out
of ``receive_data``: the affected call or the whole connection ends with the
gRPC status the spec prescribes and an event says so.

Wire behaviour follows grpc/grpc ``doc/PROTOCOL-HTTP2.md`` and
``doc/compression.md``.
"""

from __future__ import annotations

import enum
import heapq
import struct
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from protocol.grpc_metadata import (
    Metadata,
    MetadataError,
    MetadataValue,
    StatusCode,
    decode_grpc_message,
    decode_metadata,
    decode_timeout,
    encode_grpc_message,
    encode_metadata,
    encode_timeout,
    validate_metadata,
)
from protocol.grpc_types import (
    GOAWAY_ACK_TIMEOUT,
    CallEnded,
    CallLimitReached,
    CallStarted,
    ConnectionTerminated,
    EndCause,
    Event,
    GoAwayReceived,
    GrpcConfig,
    InputEnded,
    InvalidMetadata,
    LocalProtocolError,
    MessageReceived,
    MessageTooLarge,
    PingAcknowledged,
    ResponseHeadersReceived,
    SendBufferDrained,
)
from protocol.h2_budgets import (
    ENHANCE_YOUR_CALM, BudgetExceeded, ConnectionBudgets, FrameScanner, TokenBucket,
)
from protocol.h2_tuned import DIRECT_DATA_MIN, TunedH2Connection

__all__ = [
    "CallEnded", "CallLimitReached", "CallStarted", "ConnectionBudgets", "ConnectionTerminated",
    "EndCause", "Event",
    "GOAWAY_ACK_TIMEOUT",
    "GoAwayReceived", "GrpcConfig", "GrpcConnection", "InputEnded", "InvalidMetadata",
    "LocalProtocolError", "MessageReceived", "MessageTooLarge", "Metadata",
    "MetadataError", "MetadataValue", "PingAcknowledged",
    "ResponseHeadersReceived", "SendBufferDrained", "StatusCode",
    "decode_grpc_message", "decode_timeout", "encode_grpc_message",
    "encode_timeout", "status_for_http", "status_for_reset",
]


def _checked(metadata: Metadata) -> Metadata:
    try:
        return validate_metadata(metadata)
    except MetadataError as exc:
        raise InvalidMetadata(str(exc)) from exc



# ---------------------------------------------------------------------------
# Calls

_PREFIX = struct.Struct(">BI")
#: Pieces of a message spanning frames at least this large are kept by
#: reference until the message is complete; smaller ones are copied
#: together at once.
_PIECE_MIN = 8 * 1024
#: WINDOW_UPDATE increments below this count as frames that do nothing.
_TINY_WINDOW_UPDATE = 1024
_SUPPORTED_ENCODINGS = ("identity", "gzip")
_ACCEPT_ENCODING = b"identity,gzip"
_ERR = h2.errors.ErrorCodes

#: PROTOCOL-HTTP2 "Errors": RST_STREAM code received -> status.
_RESET_STATUS = {
    _ERR.NO_ERROR: StatusCode.INTERNAL,
    _ERR.PROTOCOL_ERROR: StatusCode.INTERNAL,
    _ERR.INTERNAL_ERROR: StatusCode.INTERNAL,
    _ERR.FLOW_CONTROL_ERROR: StatusCode.INTERNAL,
    _ERR.SETTINGS_TIMEOUT: StatusCode.INTERNAL,
    _ERR.STREAM_CLOSED: StatusCode.INTERNAL,
    _ERR.FRAME_SIZE_ERROR: StatusCode.INTERNAL,
    _ERR.REFUSED_STREAM: StatusCode.UNAVAILABLE,
    _ERR.CANCEL: StatusCode.CANCELLED,
    _ERR.COMPRESSION_ERROR: StatusCode.INTERNAL,
    _ERR.CONNECT_ERROR: StatusCode.INTERNAL,
    _ERR.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
    _ERR.INADEQUATE_SECURITY: StatusCode.PERMISSION_DENIED,
    _ERR.HTTP_1_1_REQUIRED: StatusCode.INTERNAL,
}

#: grpc/grpc doc/http-grpc-status-mapping.md: HTTP status without a
#: grpc-status -> status.
_HTTP_STATUS = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


def status_for_reset(error_code: int) -> StatusCode:
    """The gRPC status a client reports for a received RST_STREAM code."""
    try:
        return _RESET_STATUS[_ERR(error_code)]
    except ValueError:
        return StatusCode.INTERNAL


def status_for_http(http_status: int) -> StatusCode:
    """The gRPC status for a non-200 HTTP response without grpc-status."""
    return _HTTP_STATUS.get(http_status, StatusCode.UNKNOWN)


class _Phase(enum.Enum):
    """Where a call is, as far as the application is concerned.

    Client: WAITING_HEADERS -> RECEIVING -> (removed on CallEnded).
    Server: WAITING_HEADERS (no response headers sent) -> RECEIVING
    (headers sent) -> CLOSING (status queued behind flow control) ->
    (removed once the status is written).
    """

    WAITING_HEADERS = "waiting-headers"
    RECEIVING = "receiving"
    CLOSING = "closing"


class _Call:
    """Per-stream state: reassembly, the send queue and the phase."""

    __slots__ = (
        "stream_id", "phase", "deadline", "send_encoding", "recv_encoding",
        "accept_encodings", "buf", "parts", "have", "need", "msg_flag", "in_body",
        "discarding",
        "pending", "pending_bytes", "pending_end", "unacked", "remote_closed",
        "local_closed",
    )

    def __init__(self, stream_id: int, deadline: float | None) -> None:
        self.stream_id = stream_id
        self.phase = _Phase.WAITING_HEADERS
        self.deadline = deadline
        self.send_encoding: str | None = None
        self.recv_encoding: str | None = None
        self.accept_encodings: tuple[str, ...] = ()
        # Reassembly: bytes of the current prefix or body seen so far.
        self.buf = bytearray()
        # Reassembly of a body that spans frames: its pieces, not copied
        # until the last one arrives, and their total length.
        self.parts: list[bytes | bytearray] = []
        self.have = 0
        self.need = 5
        self.msg_flag = 0
        self.in_body = False
        # After a receive-side error the rest of the stream is dropped.
        self.discarding = False
        # Send queue: framed bytes waiting for window, then maybe an end.
        self.pending: deque[bytes | memoryview] = deque()
        self.pending_bytes = 0
        self.pending_end: list[tuple[bytes, bytes]] | bool | None = None
        self.unacked = 0
        self.remote_closed = False
        self.local_closed = False


def _header_map(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """First value of each header name (gRPC's reserved headers are single)."""
    result: dict[bytes, bytes] = {}
    for name, value in headers:
        if name not in result:
            result[name] = value
    return result


def _header_list_size(headers: list[tuple[bytes, bytes]]) -> int:
    """RFC 7540 6.5.2: name + value + 32 per header."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


def _parse_status(fields: dict[bytes, bytes]) -> tuple[StatusCode, str] | None:
    raw = fields.get(b"grpc-status")
    if raw is None:
        return None
    message = decode_grpc_message(fields.get(b"grpc-message", b""))
    try:
        value = int(raw)
    except ValueError:
        return StatusCode.UNKNOWN, f"malformed grpc-status {raw!r}: {message}"
    try:
        return StatusCode(value), message
    except ValueError:
        return StatusCode.UNKNOWN, message


class _CallFailed(Exception):
    """Internal: a received message or header breaks this call alone."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class GrpcConnection:
    """One HTTP/2 connection carrying gRPC calls, client or server role.

    Typical use (the adapter does this on every read and timer)::

        events = conn.receive_data(data, now)
        ... handle events, issue commands ...
        data = conn.data_to_send()     # queued messages go to HTTP/2 here
        ... handle conn.take_events() until empty (commands and
            data_to_send() can cause events too), then:
        transport.write(data + conn.data_to_send())
        rearm_timer(conn.next_deadline())

    :meth:`buffers_to_send` is :meth:`data_to_send` as a list of buffers,
    for a gathering write that does not copy large messages.
    """

    def __init__(self, config: GrpcConfig) -> None:
        self.config = config
        self._client = config.client_side
        # Outbound headers are built here from validated parts (lowercase
        # names, checked metadata), so h2's per-header outbound checks are
        # redundant work on every call; inbound validation stays on.
        self._h2 = TunedH2Connection(h2.config.H2Configuration(
            client_side=config.client_side, header_encoding=None,
            validate_outbound_headers=False, normalize_outbound_headers=False,
        ))
        self._authenticated = config.client_side or not config.require_authentication
        trusted = self._authenticated
        window, streams = config.limits(trusted)
        settings: dict[h2.settings.SettingCodes, int] = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: config.max_inbound_frame_size,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.max_header_list_size,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: streams,
        }
        if config.client_side:
            settings[h2.settings.SettingCodes.ENABLE_PUSH] = 0
        self._h2.local_settings = h2.settings.Settings(
            client=config.client_side, initial_values=settings)
        # Applied at once (PERF-NOTES): a big frame may arrive in the same
        # read as the peer's ack of our SETTINGS.
        self._h2.max_inbound_frame_size = config.max_inbound_frame_size
        # HPACK's own limit turns an oversized header block into a
        # connection error; keep it well above ours so that the per-call
        # check (RESOURCE_EXHAUSTED for that call alone) is what applies.
        self._h2.decoder.max_header_list_size = max(4 * config.max_header_list_size, 65_536)
        # The budgets: frames are checked as their headers arrive, before h2.
        budgets = config.budgets if trusted else config.unauthenticated_budgets
        self._scanner = FrameScanner(
            budgets, preface_size=0 if config.client_side else 24,
            max_data_frame_size=min(window, config.max_inbound_frame_size),
            max_header_list_size=config.max_header_list_size)
        self._resets = TokenBucket(budgets.reset_rate, budgets.reset_burst)
        self._partial_budget = config.partial_message_budget(trusted)
        # Bytes of incomplete messages held over all calls.
        self._partial_total = 0
        # Input held back by the frames-per-receive budget: a read, and
        # where in it the next receive starts (so it is never copied).
        self._backlog = b""
        self._backlog_at = 0
        # The connection receive window opened so far (RFC 9113's initial).
        self._connection_window = 65_535
        self._calls: dict[int, _Call] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._events: list[Event] = []
        self._initiated = False
        self._terminated = False
        self._goaway_sent = False
        self._goaway_received = False
        self._goaway_last_id = 2**31 - 1
        self._goaway_debug = b""
        # A draining server's PING sent behind its first GOAWAY, and when it
        # sends the final GOAWAY without the ack.
        self._goaway_ping: bytes | None = None
        self._goaway_ping_deadline: float | None = None
        self._ping_counter = 0
        self._pings: dict[bytes, float] = {}
        self._last_received = 0.0
        self._keepalive_payload: bytes | None = None
        self._keepalive_deadline: float | None = None
        self._last_ping_received: float | None = None
        self._ping_strikes = 0
        # Calls with messages queued since the last data_to_send().
        self._dirty: dict[int, _Call] = {}
        # Calls this machine ended (CallEnded queued) since the last input.
        self._just_ended: set[int] = set()

    # -- driving ----------------------------------------------------------

    def initiate(self, now: float) -> None:
        """Queue the connection preface and our SETTINGS; call once first."""
        if self._initiated:
            raise LocalProtocolError("connection already initiated")
        self._initiated = True
        self._last_received = now
        self._h2.initiate_connection()
        self._open_connection_window()

    def _open_connection_window(self) -> None:
        config = self.config
        target = (config.connection_window_size if self._authenticated
                  else min(config.unauthenticated_window_size, config.connection_window_size))
        if self._initiated and target > self._connection_window:
            self._h2.increment_flow_control_window(target - self._connection_window)
            self._connection_window = target

    def authenticate(self) -> None:
        """Server: a call on this connection passed authentication, so the
        peer gets the full limits (streams, windows, partial budget) from now
        on; new SETTINGS and a connection WINDOW_UPDATE tell it so.  Idempotent.

        Until then a message is bounded by the partial budget (one small
        window) rather than refused by its length prefix: a legitimate first
        message may arrive in the read that also carries the credentials."""
        if self._authenticated or self._terminated:
            return
        self._authenticated = True
        config = self.config
        self._partial_budget = config.partial_message_budget()
        # Allow the larger frames at once: the peer may use the new window
        # as soon as it has our SETTINGS, before we see its ack.
        self._scanner.max_data_frame_size = min(config.initial_window_size,
                                                config.max_inbound_frame_size)
        self._scanner.use(config.budgets)
        self._resets = TokenBucket(config.budgets.reset_rate, config.budgets.reset_burst)
        self._h2.update_settings({
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: config.initial_window_size,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.max_concurrent_streams,
        })
        self._open_connection_window()

    @property
    def authenticated(self) -> bool:
        """Whether the full limits apply (see :meth:`authenticate`)."""
        return self._authenticated

    def output_stalled(self) -> None:
        """The transport stopped taking our bytes (the peer is not reading):
        control frames that need a reply count against
        ``budgets.max_stalled_control_replies`` until :meth:`output_drained`."""
        self._scanner.output_stalled = True

    def output_drained(self) -> None:
        """The transport took what we wrote again."""
        self._scanner.output_stalled = False
        self._scanner.stalled_replies = 0

    def receive_data(self, data: bytes, now: float) -> list[Event]:
        """Feed bytes read from the transport; return what they caused.

        At most ``budgets.max_frames_per_receive`` frames are processed; the
        rest is kept (:attr:`has_pending_input`) for :meth:`receive_pending`,
        and the caller should stop reading until it is gone.
        """
        if self._terminated:
            return self.take_events()
        if self.has_pending_input:
            # More input while some is held back (a TLS layer may deliver
            # several records at once): it queues behind.
            self._backlog = self._backlog[self._backlog_at:] + data
            self._backlog_at = 0
            return self.receive_pending(now)
        return self._receive(data, 0, now)

    @property
    def has_pending_input(self) -> bool:
        """Whether received bytes wait for :meth:`receive_pending`."""
        return len(self._backlog) > self._backlog_at and not self._terminated

    def receive_pending(self, now: float) -> list[Event]:
        """Process the next part of the input kept by :meth:`receive_data`."""
        if not self.has_pending_input:
            return self.take_events()
        data, start = self._backlog, self._backlog_at
        self._backlog, self._backlog_at = b"", 0
        return self._receive(data, start, now)

    def _receive(self, data: bytes, start: int, now: float) -> list[Event]:
        self._just_ended.clear()
        self._last_received = now
        self._keepalive_deadline = None
        view: bytes | memoryview = memoryview(data)[start:] if start else data
        consumed, violation = self._scanner.scan(view, now)
        if consumed < len(view):
            if violation is None:
                self._backlog, self._backlog_at = data, start + consumed
            view = memoryview(view)[:consumed]
        if view:
            try:
                h2_events = self._h2.receive_data(view)
            except h2.exceptions.ProtocolError as exc:
                # h2 has queued a GOAWAY with the right code already.
                code = getattr(exc, "error_code", _ERR.PROTOCOL_ERROR)
                self._backlog, self._backlog_at = b"", 0
                self._terminate(int(code), f"HTTP/2 protocol error: {exc}", remote=False,
                                status=StatusCode.UNAVAILABLE)
                return self.take_events()
            handlers = self._handlers
            for event in h2_events:
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(self, event, now)
                if self._terminated:
                    break
        if violation is not None:
            self._exceeded(violation)
        return self.take_events()

    def _exceeded(self, violation: BudgetExceeded) -> None:
        """A peer went over a budget: GOAWAY (naming the last stream we
        took) with the violation's code, and every call ends."""
        self._backlog, self._backlog_at = b"", 0
        if self._terminated:
            return
        self._h2.close_connection(error_code=violation.error_code,
                                  additional_data=violation.reason.encode("ascii"))
        self._terminate(violation.error_code, violation.reason, remote=False,
                        status=StatusCode.UNAVAILABLE)

    def take_events(self) -> list[Event]:
        """Events caused by commands rather than input (e.g. the graceful
        drain finishing when the last call ends); :meth:`receive_data` and
        :meth:`handle_timeout` include these in what they return."""
        events = self._events
        self._events = []
        return events

    def data_to_send(self) -> bytes:
        """Bytes to write to the transport now (empties the buffer).

        Queued messages go out here, as far as flow control allows; this may
        cause events (:meth:`take_events`): SendBufferDrained for calls whose
        queue emptied, and ends of calls whose status was waiting.
        """
        self._hand_over()
        return self._h2.data_to_send()

    def _hand_over(self) -> None:
        if self._dirty:
            dirty = self._dirty
            self._dirty = {}
            for call in dirty.values():
                if call.pending and call.stream_id in self._calls:
                    self._flush(call)

    def buffers_to_send(self) -> list[bytes | memoryview]:
        """What :meth:`data_to_send` returns, as a list of buffers to write
        in order (empties the buffer): large message payloads come out as
        the very objects given to :meth:`send_message`, uncopied, for a
        gathering write (``writeSequence``, ``sendmsg``)."""
        self._hand_over()
        return self._h2.buffers_to_send()

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must next be called (None: never)."""
        if self._terminated:
            return None
        heap = self._deadlines
        calls = self._calls
        while heap:
            deadline, stream_id = heap[0]
            call = calls.get(stream_id)
            if call is not None and call.deadline == deadline:
                break
            heapq.heappop(heap)
        best = heap[0][0] if heap else None
        for timer in (self._keepalive_timer(), self._goaway_ping_deadline):
            if timer is not None and (best is None or timer < best):
                best = timer
        return best

    def _keepalive_timer(self) -> float | None:
        if self._keepalive_deadline is not None:
            return self._keepalive_deadline
        if self.config.keepalive_interval is None:
            return None
        return self._last_received + self.config.keepalive_interval

    def handle_timeout(self, now: float) -> list[Event]:
        """Expire call deadlines and keepalive timers due at ``now``."""
        if self._terminated:
            return self.take_events()
        self._just_ended.clear()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, stream_id = heapq.heappop(heap)
            call = self._calls.get(stream_id)
            if call is None or call.deadline != deadline:
                continue
            if call.phase is _Phase.CLOSING:
                # Our status is written; only flow control holds it back.
                self._reset_quietly(stream_id, _ERR.CANCEL)
                self._forget(call)
            else:
                # Server: status DEADLINE_EXCEEDED then RST_STREAM, as
                # grpc-core does, so a client whose own timer is late still
                # sees DEADLINE_EXCEEDED; client: RST_STREAM(CANCEL).
                self._fail_call(call, StatusCode.DEADLINE_EXCEEDED, "deadline exceeded",
                                EndCause.DEADLINE)
        if self._goaway_ping_deadline is not None and now >= self._goaway_ping_deadline:
            self._send_final_goaway()
        if self._terminated:
            # The last call of a draining connection just expired: no keepalive.
            return self.take_events()
        if self._keepalive_deadline is not None:
            if now >= self._keepalive_deadline:
                self._terminate(int(_ERR.NO_ERROR), "keepalive timeout", remote=True,
                                status=StatusCode.UNAVAILABLE)
        elif (self.config.keepalive_interval is not None
              and now >= self._last_received + self.config.keepalive_interval):
            self._keepalive_payload = self.ping(now)
            self._keepalive_deadline = now + self.config.keepalive_timeout
        return self.take_events()

    def connection_lost(self, reason: str = "connection lost") -> list[Event]:
        """The transport closed: every live call ends UNAVAILABLE."""
        if not self._terminated:
            self._terminate(int(_ERR.NO_ERROR), reason, remote=True,
                            status=StatusCode.UNAVAILABLE)
        return self.take_events()

    # -- client commands -------------------------------------------------

    def start_call(
        self,
        method: str,
        metadata: Metadata = (),
        timeout: float | None = None,
        *,
        authority: str = "localhost",
        scheme: str = "http",
        encoding: str | None = None,
        now: float,
    ) -> int:
        """Client: open a call (request headers) and return its stream id.

        ``timeout`` (seconds) becomes ``grpc-timeout`` and a local deadline
        at ``now + timeout``: the call ends DEADLINE_EXCEEDED by itself.
        ``encoding="gzip"`` declares request compression (then
        ``send_message(compress=True)`` compresses).  Raises
        :class:`CallLimitReached` when the peer's stream limit is reached.
        """
        if not self._client:
            raise LocalProtocolError("start_call on a server connection")
        if not self.accepting_calls:
            raise LocalProtocolError("connection is not accepting new calls")
        if encoding is not None and encoding not in _SUPPORTED_ENCODINGS:
            raise LocalProtocolError(f"unsupported encoding {encoding!r}")
        metadata = _checked(metadata)
        if self._h2.open_outbound_streams >= self._h2.remote_settings.max_concurrent_streams:
            raise CallLimitReached("peer's max concurrent streams reached")
        stream_id = self._h2.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", scheme.encode("ascii")),
            (b":path", method.encode("ascii")),
            (b":authority", authority.encode("ascii")),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"user-agent", self.config.user_agent.encode("ascii")),
            (b"grpc-accept-encoding", _ACCEPT_ENCODING),
        ]
        deadline = None
        if timeout is not None:
            headers.append((b"grpc-timeout", encode_timeout(timeout).encode("ascii")))
            deadline = now + timeout
        if encoding is not None and encoding != "identity":
            headers.append((b"grpc-encoding", encoding.encode("ascii")))
        if metadata:
            headers.extend(encode_metadata(metadata))
        self._h2.send_headers(stream_id, headers)
        self._sent_frames()
        call = _Call(stream_id, deadline)
        call.send_encoding = encoding if encoding != "identity" else None
        self._calls[stream_id] = call
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, stream_id))
        return stream_id

    def end_stream(self, stream_id: int) -> None:
        """Client: half-close (no more request messages); sent after any
        queued messages."""
        if self._ended_unseen(stream_id):
            return
        call = self._live_call(stream_id)
        if not self._client:
            raise LocalProtocolError("end_stream is a client command; use send_status")
        if call.local_closed:
            raise LocalProtocolError(f"stream {stream_id} already half-closed")
        call.local_closed = True
        if call.pending:
            call.pending_end = True
        else:
            try:
                self._h2.end_stream(stream_id)
            except h2.exceptions.StreamClosedError:
                pass  # closed by the peer in the input being processed

    def cancel(self, stream_id: int) -> None:
        """Either side: abandon the call with RST_STREAM(CANCEL).  No event
        follows for this stream; a client should treat it as CANCELLED."""
        if self._ended_unseen(stream_id):
            return
        call = self._calls.get(stream_id)
        if call is None:
            raise LocalProtocolError(f"no live call on stream {stream_id}")
        self._reset_quietly(stream_id, _ERR.CANCEL)
        self._forget(call)

    # -- server commands -------------------------------------------------

    def send_initial_metadata(
        self, stream_id: int, metadata: Metadata = (), *, encoding: str | None = None,
    ) -> None:
        """Server: send response headers now (otherwise they go out with the
        first message).  ``encoding="gzip"`` lets ``send_message(...,
        compress=True)`` compress; ignored if the client does not accept it."""
        if self._ended_unseen(stream_id):
            return
        call = self._live_call(stream_id)
        if self._client:
            raise LocalProtocolError("send_initial_metadata is a server command")
        if call.phase is not _Phase.WAITING_HEADERS:
            raise LocalProtocolError(f"headers already sent on stream {stream_id}")
        metadata = _checked(metadata)
        self._send_response_headers(call, metadata, encoding)

    def _send_response_headers(self, call: _Call, metadata: Metadata,
                               encoding: str | None) -> None:
        headers = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", _ACCEPT_ENCODING),
        ]
        if (encoding is not None and encoding != "identity"
                and encoding in _SUPPORTED_ENCODINGS and encoding in call.accept_encodings):
            call.send_encoding = encoding
            headers.append((b"grpc-encoding", encoding.encode("ascii")))
        if metadata:
            headers.extend(encode_metadata(metadata))
        call.phase = _Phase.RECEIVING
        try:
            self._h2.send_headers(call.stream_id, headers)
        except h2.exceptions.StreamClosedError:
            # Reset by the peer in the input being processed: the event
            # saying so is on its way.
            return
        self._sent_frames()

    def send_status(
        self, stream_id: int, code: StatusCode, message: str = "", trailers: Metadata = (),
    ) -> None:
        """Server: end the call with a status.  Trailers-only if no headers
        were sent; queued after any pending messages; followed by
        RST_STREAM(NO_ERROR) if the client had not half-closed."""
        if self._ended_unseen(stream_id):
            return
        call = self._live_call(stream_id)
        if self._client:
            raise LocalProtocolError("send_status is a server command; use end_stream")
        trailers = _checked(trailers)
        self._queue_status(call, StatusCode(code), message, trailers)

    def _queue_status(self, call: _Call, code: StatusCode, message: str,
                      trailers: Metadata,
                      extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        headers: list[tuple[bytes, bytes]] = []
        if call.phase is _Phase.WAITING_HEADERS:
            headers += [(b":status", b"200"), (b"content-type", b"application/grpc")]
        headers.append((b"grpc-status", b"%d" % code))
        if message:
            headers.append((b"grpc-message", encode_grpc_message(message).encode("ascii")))
        headers.extend(extra)
        if trailers:
            headers.extend(encode_metadata(trailers))
        call.phase = _Phase.CLOSING
        call.local_closed = True
        if call.pending:
            call.pending_end = headers
        else:
            self._write_status(call, headers)

    def _write_status(self, call: _Call, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            self._h2.send_headers(call.stream_id, headers, end_stream=True)
        except h2.exceptions.StreamClosedError:
            # The peer reset it in the input being processed; nothing to say.
            self._forget(call)
            return
        self._sent_frames()
        if not call.remote_closed:
            # Early status: tell the client to stop sending (PROTOCOL-HTTP2).
            self._reset_quietly(call.stream_id, _ERR.NO_ERROR)
        self._forget(call)

    # -- both sides -------------------------------------------------------

    def send_message(self, stream_id: int, data: bytes, *, compress: bool = False) -> None:
        """Send one message.  It is handed to HTTP/2 at the next
        :meth:`data_to_send` (so a burst of messages shares DATA frames) and
        stays queued while flow control forbids sending.

        ``compress`` compresses with the call's encoding when it has one.
        Raises :class:`MessageTooLarge` over ``max_send_message_length``.
        """
        if self._ended_unseen(stream_id):
            return
        call = self._calls.get(stream_id)
        if call is None or call.local_closed:
            raise LocalProtocolError(f"stream {stream_id} cannot send messages")
        limit = self.config.max_send_message_length
        if limit is not None and len(data) > limit:
            raise MessageTooLarge(
                f"message of {len(data)} bytes is over the send limit of {limit}")
        if call.phase is _Phase.WAITING_HEADERS and not self._client:
            self._send_response_headers(call, (), None)
        flag = 0
        if compress and call.send_encoding == "gzip":
            data = zlib.compress(data, 6, 31)
            flag = 1
        # Queued until data_to_send(): messages sent in a burst then share
        # DATA frames, which is most of the cost for small messages.  A large
        # payload stays a separate (immutable) buffer that is written by
        # reference, never joined with its prefix.
        if len(data) >= DIRECT_DATA_MIN:
            call.pending.append(_PREFIX.pack(flag, len(data)))
            call.pending.append(data if type(data) is bytes else bytes(data))
        else:
            call.pending.append(_PREFIX.pack(flag, len(data)) + data)
        call.pending_bytes += 5 + len(data)
        self._dirty[stream_id] = call

    def buffered_amount(self, stream_id: int) -> int:
        """Bytes of this call's messages not yet handed to HTTP/2 (queued
        until data_to_send() or waiting for flow-control window); 0 for
        unknown or finished calls."""
        call = self._calls.get(stream_id)
        return 0 if call is None else call.pending_bytes

    def acknowledge(self, stream_id: int, n: int) -> None:
        """The caller consumed ``n`` flow-controlled bytes of this call (see
        :attr:`MessageReceived.flow_controlled_length`); reopens windows.
        Acknowledging on an ended call is a no-op: its bytes were returned
        to the connection when it ended."""
        call = self._calls.get(stream_id)
        if call is None or n <= 0:
            return
        n = min(n, call.unacked)
        if n:
            call.unacked -= n
            self._h2.acknowledge_received_data(n, stream_id)

    def ping(self, now: float) -> bytes:
        """Send a PING; returns its 8-byte payload (see PingAcknowledged)."""
        if self._terminated:
            raise LocalProtocolError("connection terminated")
        self._ping_counter += 1
        payload = struct.pack(">Q", self._ping_counter)
        self._pings[payload] = now
        self._h2.ping(payload)
        return payload

    def go_away(self, error_code: int = 0, debug_data: bytes = b"",
                now: float | None = None) -> list[Event]:
        """Stop accepting calls.  With error_code 0 this is a graceful drain:
        calls already started finish, then ConnectionTerminated(0) follows;
        otherwise every call ends now (UNAVAILABLE).

        A server drains in two phases (RFC 9113 6.8, as grpc-core does):
        a GOAWAY that refuses nothing with a PING behind it, then, on the
        PING's ack (or ``GOAWAY_ACK_TIMEOUT`` after ``now``, default the
        last input's time), the GOAWAY naming the last stream it serves.
        Calls the client started before it saw the first GOAWAY arrive
        before the ack and are served rather than refused."""
        if self._terminated:
            return self.take_events()
        if error_code:
            self._h2.close_connection(error_code=error_code, additional_data=debug_data)
            self._terminate(error_code, "local GOAWAY", remote=False,
                            status=StatusCode.UNAVAILABLE)
        elif not self._goaway_sent:
            self._goaway_sent = True
            self._goaway_debug = debug_data
            if self._client:
                # A client never accepts streams, so its last id is 0.
                self._goaway_last_id = 0
                self._h2.send_graceful_goaway(0, debug_data)
            else:
                self._h2.send_graceful_goaway(2**31 - 1, debug_data)
                self._ping_counter += 1
                self._goaway_ping = struct.pack(">Q", self._ping_counter)
                self._h2.ping(self._goaway_ping)
                start = self._last_received if now is None else now
                self._goaway_ping_deadline = start + GOAWAY_ACK_TIMEOUT
            self._maybe_drained()
        return self.take_events()

    def _send_final_goaway(self) -> None:
        self._goaway_ping = None
        self._goaway_ping_deadline = None
        self._goaway_last_id = self._h2.highest_inbound_stream_id
        self._h2.send_graceful_goaway(self._goaway_last_id, self._goaway_debug)
        self._maybe_drained()

    @property
    def active_calls(self) -> int:
        """Calls currently open on this connection."""
        return len(self._calls)

    @property
    def accepting_calls(self) -> bool:
        """False once a GOAWAY was sent or received or the connection ended."""
        return not (self._terminated or self._goaway_sent or self._goaway_received)

    @property
    def max_concurrent_calls(self) -> int:
        """The peer's SETTINGS_MAX_CONCURRENT_STREAMS (client side)."""
        return int(self._h2.remote_settings.max_concurrent_streams)

    # -- internals: calls -------------------------------------------------

    def _ended_unseen(self, stream_id: int) -> bool:
        """Whether a command on this call is an answer to a stale event.

        One input can deliver a message and then end its call (the next
        message in the same DATA frame is over the limit, say): the caller
        may answer the MessageReceived before it reaches the CallEnded later
        in the same batch.  Such commands are dropped instead of refused; a
        command after the next input is misuse again.
        """
        if stream_id not in self._just_ended:
            return False
        call = self._calls.get(stream_id)
        return call is None or call.phase is _Phase.CLOSING or call.local_closed

    def _live_call(self, stream_id: int) -> _Call:
        call = self._calls.get(stream_id)
        if call is None or call.phase is _Phase.CLOSING:
            raise LocalProtocolError(f"no live call on stream {stream_id}")
        return call

    def _sent_frames(self) -> None:
        # grpc-core's ping abuse policy: pings are fine while we are sending.
        self._ping_strikes = 0
        self._last_ping_received = None

    def _reset_quietly(self, stream_id: int, code: int) -> None:
        stream = self._h2.streams.get(stream_id)
        if stream is not None and not stream.closed:
            self._h2.reset_stream(stream_id, code)

    def _forget(self, call: _Call) -> None:
        """Drop a call; return its unconsumed bytes to the connection window."""
        if self._calls.pop(call.stream_id, None) is None:
            return
        self._drop_partial(call)
        call.pending.clear()
        call.pending_bytes = 0
        if call.unacked:
            self._h2.acknowledge_received_data(call.unacked, call.stream_id)
            call.unacked = 0
        self._maybe_drained()

    def _end_call(self, call: _Call, status: StatusCode, message: str,
                  trailers: Metadata, cause: EndCause, reset_code: int | None = None) -> None:
        self._events.append(CallEnded(call.stream_id, status, message, trailers, cause,
                                      reset_code))
        self._just_ended.add(call.stream_id)
        self._forget(call)

    def _fail_call(self, call: _Call, code: StatusCode, message: str,
                   cause: EndCause = EndCause.SYNTHESIZED) -> None:
        """End a call on our own initiative (not the peer's status): what we
        received on it is unacceptable, or its deadline passed."""
        call.discarding = True
        self._drop_partial(call)
        if self._client:
            self._reset_quietly(call.stream_id, _ERR.CANCEL)
            self._end_call(call, code, message, (), cause)
            return
        call.pending.clear()
        call.pending_bytes = 0
        call.pending_end = None
        self._events.append(CallEnded(call.stream_id, code, message, (), cause))
        self._just_ended.add(call.stream_id)
        self._queue_status(call, code, message, ())

    def _maybe_drained(self) -> None:
        if (not self._calls and not self._terminated and self._goaway_ping is None
                and (self._goaway_sent or self._goaway_received)):
            self._terminated = True
            self._events.append(ConnectionTerminated(
                0, "drained after GOAWAY", remote=self._goaway_received and not self._goaway_sent))

    def _terminate(self, error_code: int, reason: str, *, remote: bool,
                   status: StatusCode) -> None:
        self._terminated = True
        for call in list(self._calls.values()):
            self._end_call(call, status, reason, (), EndCause.CONNECTION)
        self._events.append(ConnectionTerminated(error_code, reason, remote))

    # -- internals: sending -------------------------------------------------

    def _flush(self, call: _Call) -> None:
        """Hand queued bytes to h2 as far as windows allow, then any queued
        end; SendBufferDrained once the queue is empty."""
        try:
            self._flush_stream(call)
        except h2.exceptions.StreamClosedError:
            # The peer closed the stream in the input being processed (e.g.
            # a trailers-only rejection arriving with a window update); its
            # event ends the call, so what was queued is dropped.
            call.pending.clear()
            call.pending_bytes = 0
            call.pending_end = None

    def _flush_stream(self, call: _Call) -> None:
        h2conn = self._h2
        stream_id = call.stream_id
        pending = call.pending
        while pending:
            window = h2conn.local_flow_control_window(stream_id)
            if window <= 0:
                return
            limit = min(window, h2conn.max_outbound_frame_size)
            # Fill one DATA frame: whole messages while they fit, then the
            # part of the next one that does.
            parts: list[bytes | memoryview] = []
            size = 0
            while pending and size < limit:
                part = pending[0]
                large = len(part) >= DIRECT_DATA_MIN
                if size and large:
                    # A large payload is a DATA frame of its own, so that
                    # the receiver can take it without copying
                    # (:meth:`_reassemble`).
                    break
                room = limit - size
                if len(part) > room:
                    view = part if isinstance(part, memoryview) else memoryview(part)
                    parts.append(view[:room])
                    pending[0] = view[room:]
                    size = limit
                    break
                pending.popleft()
                parts.append(part)
                size += len(part)
                if large:
                    break
            call.pending_bytes -= size
            if size >= DIRECT_DATA_MIN:
                h2conn.send_data_parts(stream_id, parts, size)
            else:
                # A half-close right behind the last message rides on its
                # frame rather than an empty DATA frame of its own.
                end_here = not pending and call.pending_end is True
                if end_here:
                    call.pending_end = None
                h2conn.send_data(stream_id, parts[0] if len(parts) == 1 else b"".join(parts),
                                 end_stream=end_here)
        self._sent_frames()
        end = call.pending_end
        if end is not None:
            call.pending_end = None
            if end is True:
                h2conn.end_stream(stream_id)
            elif isinstance(end, list):
                self._write_status(call, end)
                return
        self._events.append(SendBufferDrained(stream_id))

    def _flush_all(self) -> None:
        for call in list(self._calls.values()):
            if call.pending and call.stream_id in self._calls:
                self._flush(call)

    # -- internals: receiving ----------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived, now: float) -> None:
        stream_id = event.stream_id
        assert stream_id is not None
        headers = list(event.headers or ())
        if self._goaway_sent and stream_id > self._goaway_last_id:
            self._reset_quietly(stream_id, _ERR.REFUSED_STREAM)
            return
        fields = _header_map(headers)
        call = _Call(stream_id, None)
        call.remote_closed = event.stream_ended is not None
        self._calls[stream_id] = call

        def reject(code: StatusCode, message: str, http_status: bytes = b"200",
                   extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
            call.discarding = True
            if http_status != b"200":
                out = [(b":status", http_status), (b"grpc-status", b"%d" % code),
                       (b"grpc-message", encode_grpc_message(message).encode("ascii"))]
                call.phase = _Phase.CLOSING
                self._write_status(call, out)
            else:
                self._queue_status(call, code, message, (), extra)

        if _header_list_size(headers) > self.config.max_header_list_size:
            return reject(StatusCode.RESOURCE_EXHAUSTED, "request header list too large")
        if fields.get(b":method") != b"POST":
            return reject(StatusCode.INTERNAL, "gRPC requires POST", b"405")
        content_type = fields.get(b"content-type", b"")
        if not content_type.startswith(b"application/grpc"):
            return reject(StatusCode.INTERNAL,
                          f"invalid content-type {content_type.decode('latin-1')!r}", b"415")
        path = fields.get(b":path", b"")
        encoding_raw = fields.get(b"grpc-encoding")
        if encoding_raw is not None:
            encoding = encoding_raw.decode("ascii", errors="replace")
            if encoding not in _SUPPORTED_ENCODINGS:
                return reject(StatusCode.UNIMPLEMENTED,
                              f"grpc-encoding {encoding!r} is not supported",
                              extra=((b"grpc-accept-encoding", _ACCEPT_ENCODING),))
            call.recv_encoding = None if encoding == "identity" else encoding
        accept = fields.get(b"grpc-accept-encoding")
        if accept is not None:
            call.accept_encodings = tuple(
                part.strip() for part in accept.decode("ascii", errors="replace").split(","))
        deadline = None
        timeout_raw = fields.get(b"grpc-timeout")
        if timeout_raw is not None:
            try:
                deadline = now + decode_timeout(timeout_raw)
            except MetadataError as exc:
                return reject(StatusCode.INTERNAL, str(exc))
        try:
            metadata = decode_metadata(headers)
        except MetadataError as exc:
            return reject(StatusCode.INTERNAL, str(exc))
        call.deadline = deadline
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, stream_id))
        authority = fields.get(b":authority")
        self._events.append(CallStarted(
            stream_id, path.decode("utf-8", errors="replace"), metadata, deadline,
            None if authority is None else authority.decode("utf-8", errors="replace"),
            call.recv_encoding, call.accept_encodings))

    def _on_response(self, event: h2.events.ResponseReceived, now: float) -> None:
        call = self._calls.get(event.stream_id or 0)
        if call is None:
            return
        headers = list(event.headers or ())
        fields = _header_map(headers)
        ended = event.stream_ended is not None
        if _header_list_size(headers) > self.config.max_header_list_size:
            return self._fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                                   "response header list too large")
        if ended:
            call.remote_closed = True
            self._finish_from_headers(call, fields, headers, trailers_only=True)
            return
        http_status = fields.get(b":status", b"")
        if http_status != b"200":
            try:
                code = status_for_http(int(http_status))
            except ValueError:
                code = StatusCode.UNKNOWN
            return self._fail_call(call, code,
                                   f"unexpected HTTP status {http_status.decode('latin-1')}")
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            return self._fail_call(call, StatusCode.INTERNAL, "response is not application/grpc")
        encoding_raw = fields.get(b"grpc-encoding")
        if encoding_raw is not None:
            encoding = encoding_raw.decode("ascii", errors="replace")
            if encoding not in _SUPPORTED_ENCODINGS:
                return self._fail_call(call, StatusCode.INTERNAL,
                                       f"response grpc-encoding {encoding!r} not supported")
            call.recv_encoding = None if encoding == "identity" else encoding
        try:
            metadata = decode_metadata(headers)
        except MetadataError as exc:
            return self._fail_call(call, StatusCode.INTERNAL, str(exc))
        call.phase = _Phase.RECEIVING
        self._events.append(ResponseHeadersReceived(call.stream_id, metadata, call.recv_encoding))

    def _finish_from_headers(self, call: _Call, fields: dict[bytes, bytes],
                             headers: list[tuple[bytes, bytes]], *, trailers_only: bool) -> None:
        parsed = _parse_status(fields)
        cause = EndCause.TRAILERS_ONLY if trailers_only else EndCause.TRAILERS
        if parsed is None:
            cause = EndCause.SYNTHESIZED
            http_status = fields.get(b":status", b"200")
            if trailers_only and http_status != b"200":
                try:
                    code = status_for_http(int(http_status))
                except ValueError:
                    code = StatusCode.UNKNOWN
                parsed = (code, f"unexpected HTTP status {http_status.decode('latin-1')}")
            else:
                parsed = (StatusCode.UNKNOWN, "missing grpc-status")
        elif call.in_body or call.buf:
            if parsed[0] == StatusCode.OK:
                parsed = (StatusCode.INTERNAL, "stream ended inside a message")
                cause = EndCause.SYNTHESIZED
        try:
            trailers = decode_metadata(headers)
        except MetadataError:
            trailers = ()
        # Status received while still sending: free the stream on our side.
        self._reset_quietly(call.stream_id, _ERR.NO_ERROR)
        self._end_call(call, parsed[0], parsed[1], trailers, cause)

    def _on_trailers(self, event: h2.events.TrailersReceived, now: float) -> None:
        call = self._calls.get(event.stream_id or 0)
        if call is None:
            return
        call.remote_closed = True
        if not self._client:
            # Request trailers are not gRPC; treat them as a half-close.
            self._events.append(InputEnded(call.stream_id))
            return
        headers = list(event.headers or ())
        if _header_list_size(headers) > self.config.max_header_list_size:
            return self._fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                                   "trailer list too large")
        self._finish_from_headers(call, _header_map(headers), headers, trailers_only=False)

    def _on_data(self, event: h2.events.DataReceived, now: float) -> None:
        stream_id = event.stream_id or 0
        flow = event.flow_controlled_length or 0
        call = self._calls.get(stream_id)
        if call is None or call.discarding or call.phase is _Phase.CLOSING:
            if flow:
                self._h2.acknowledge_received_data(flow, stream_id)
            return
        data = event.data or b""
        leftover = flow - self._reassemble(call, data)
        if self._partial_total > self._partial_budget:
            self._end_largest_hoarder()
        if leftover > 0:
            # Bytes of messages not complete yet (and padding) go back to
            # the window at once, so that a message larger than a window
            # still flows; the partial budget bounds what they can hold.
            self._h2.acknowledge_received_data(leftover, stream_id)

    def _end_largest_hoarder(self) -> None:
        """Incomplete messages hold more than the connection's budget: the
        call holding most of it ends RESOURCE_EXHAUSTED (its stream reset)."""
        hoarder = max(self._calls.values(), key=lambda c: c.have)
        self._fail_call(hoarder, StatusCode.RESOURCE_EXHAUSTED,
                        f"incomplete messages over the connection's budget of "
                        f"{self._partial_budget} bytes")

    def _drop_partial(self, call: _Call) -> None:
        """Free what the call holds of an incomplete message."""
        self._partial_total -= call.have
        call.have = 0
        call.parts = []
        del call.buf[:]

    def _reassemble(self, call: _Call, data: bytes) -> int:
        """Cut ``data`` into messages; return how many of its bytes belong to
        messages delivered (those wait for the application's acknowledge;
        the bytes of a partial message are acknowledged at once so a message
        larger than the window still flows)."""
        pos = 0
        end = len(data)
        attributed = 0
        limit = self.config.max_receive_message_length
        stream_id = call.stream_id
        events = self._events
        while pos < end:
            start = pos
            if not call.in_body:
                if not call.buf and end - pos >= 5:
                    flag, length = _PREFIX.unpack_from(data, pos)
                    pos += 5
                    if length > limit:
                        return attributed + self._too_large(call, length)
                    if end - pos >= length:
                        # Whole message inside this frame: slice, no buffer.
                        payload = data[pos:pos + length]
                        pos += length
                        try:
                            message = self._decode(call, flag, payload)
                        except _CallFailed as exc:
                            self._fail_call(call, exc.code, exc.message)
                            return attributed
                        call.unacked += pos - start
                        attributed += pos - start
                        events.append(MessageReceived(stream_id, message, pos - start,
                                                      flag == 1))
                        continue
                    call.msg_flag = flag
                    call.need = length
                    call.in_body = True
                    continue
                take = min(5 - len(call.buf), end - pos)
                call.buf += data[pos:pos + take]
                pos += take
                if len(call.buf) < 5:
                    break
                flag, length = _PREFIX.unpack_from(call.buf, 0)
                del call.buf[:]
                if length > limit:
                    return attributed + self._too_large(call, length)
                call.msg_flag = flag
                call.need = length
                call.in_body = True
                if length:
                    continue
            if not call.parts and end - pos >= call.need:
                # The rest of the message is here: slice it, which copies
                # nothing when it is the whole frame (a large message from
                # infx is: its prefix travels in the frame before).
                payload = data[pos:pos + call.need]
                pos += call.need
            else:
                # Keep the pieces (a whole frame's data is kept as is) and
                # copy once, when the message is complete; small pieces are
                # gathered into a bytearray, so that tiny frames cannot
                # make a message cost an object per byte.
                take = min(call.need - call.have, end - pos)
                if take >= _PIECE_MIN:
                    call.parts.append(data[pos:pos + take])
                elif take:
                    if not call.parts or type(call.parts[-1]) is not bytearray:
                        call.parts.append(bytearray())
                    call.parts[-1] += memoryview(data)[pos:pos + take]
                call.have += take
                self._partial_total += take
                pos += take
                if call.have < call.need:
                    break
                payload = b"".join(call.parts)
                self._partial_total -= call.have
                call.parts = []
                call.have = 0
            call.in_body = False
            try:
                message = self._decode(call, call.msg_flag, payload)
            except _CallFailed as exc:
                self._fail_call(call, exc.code, exc.message)
                return attributed
            # Earlier parts of this message were acknowledged on arrival.
            call.unacked += pos - start
            attributed += pos - start
            events.append(MessageReceived(stream_id, message, pos - start, call.msg_flag == 1))
        return attributed

    def _too_large(self, call: _Call, length: int) -> int:
        self._fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                        f"received message larger than max ({length} vs. "
                        f"{self.config.max_receive_message_length})")
        return 0

    def _decode(self, call: _Call, flag: int, payload: bytes) -> bytes:
        if flag == 0:
            return payload
        if flag != 1:
            raise _CallFailed(StatusCode.INTERNAL, f"invalid message flags {flag:#x}")
        if call.recv_encoding is None:
            raise _CallFailed(StatusCode.INTERNAL,
                              "compressed message without a grpc-encoding")
        limit = self.config.max_receive_message_length
        decompressor = zlib.decompressobj(31)
        try:
            message = decompressor.decompress(payload, limit + 1)
        except zlib.error as exc:
            raise _CallFailed(StatusCode.INTERNAL, f"gzip decompression failed: {exc}") from exc
        if len(message) > limit:
            raise _CallFailed(StatusCode.RESOURCE_EXHAUSTED,
                              f"decompressed message larger than max ({limit})")
        if not decompressor.eof:
            raise _CallFailed(StatusCode.INTERNAL, "truncated gzip message")
        return message

    def _on_stream_ended(self, event: h2.events.StreamEnded, now: float) -> None:
        call = self._calls.get(event.stream_id or 0)
        if call is None or call.discarding:
            return
        call.remote_closed = True
        if self._client:
            self._fail_call(call, StatusCode.INTERNAL, "stream ended without trailers")
        elif call.phase is not _Phase.CLOSING:
            if call.in_body or call.buf:
                self._fail_call(call, StatusCode.INTERNAL, "half-closed inside a message")
            else:
                self._events.append(InputEnded(call.stream_id))

    def _on_reset(self, event: h2.events.StreamReset, now: float) -> None:
        call = self._calls.get(event.stream_id or 0)
        if call is None:
            return
        code = int(event.error_code or 0)
        if self._client:
            cause = EndCause.REFUSED if code == _ERR.REFUSED_STREAM else EndCause.RESET
            self._end_call(call, status_for_reset(code),
                           f"stream reset by peer (HTTP/2 error {code})", (), cause, code)
        elif call.phase is _Phase.CLOSING:
            self._forget(call)
        else:
            answered = call.phase is not _Phase.WAITING_HEADERS
            self._end_call(call, StatusCode.CANCELLED, "cancelled by the client", (),
                           EndCause.RESET, code)
            # Rapid reset (CVE-2023-44487): each stream opened and reset
            # before we answered it cost a call set-up and nothing for the
            # peer, so they are rate-limited (Netty's idea; see h2_budgets).
            if not answered and not self._resets.take(now):
                self._exceeded(BudgetExceeded(ENHANCE_YOUR_CALM, "too many streams reset"))

    def _on_window_updated(self, event: h2.events.WindowUpdated, now: float) -> None:
        stream_id = event.stream_id or 0
        if (event.delta or 0) < _TINY_WINDOW_UPDATE:
            # h2, grpc-core and grpc-go return at least 1 KiB at a time (or
            # a good part of the window): smaller increments are a flood.
            violation = self._scanner.idle_frame(now)
            if violation is not None:
                self._exceeded(violation)
                return
        if stream_id == 0:
            self._flush_all()
        else:
            call = self._calls.get(stream_id)
            if call is not None and call.pending:
                self._flush(call)

    def _on_settings_changed(self, event: h2.events.RemoteSettingsChanged, now: float) -> None:
        if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
            self._flush_all()

    def _on_ping(self, event: h2.events.PingReceived, now: float) -> None:
        strikes_allowed = self.config.max_ping_strikes
        if strikes_allowed:
            last = self._last_ping_received
            if last is not None and now - last < self.config.min_ping_interval:
                self._ping_strikes += 1
                if self._ping_strikes > strikes_allowed:
                    self._h2.close_connection(error_code=_ERR.ENHANCE_YOUR_CALM,
                                              additional_data=b"too_many_pings")
                    self._terminate(int(_ERR.ENHANCE_YOUR_CALM), "too many pings",
                                    remote=False, status=StatusCode.UNAVAILABLE)
                    return
        self._last_ping_received = now

    def _on_ping_ack(self, event: h2.events.PingAckReceived, now: float) -> None:
        payload = bytes(event.ping_data or b"")
        if payload == self._goaway_ping:
            self._send_final_goaway()
            return
        sent = self._pings.pop(payload, None)
        if sent is None or payload == self._keepalive_payload:
            return
        self._events.append(PingAcknowledged(payload, now - sent))

    def _on_terminated(self, event: h2.events.ConnectionTerminated, now: float) -> None:
        code = int(event.error_code or 0)
        last = event.last_stream_id if event.last_stream_id is not None else 2**31 - 1
        debug = event.additional_data or b""
        self._goaway_received = True
        self._events.append(GoAwayReceived(last, code, debug))
        if code:
            self._terminate(code, f"GOAWAY from peer (HTTP/2 error {code}): "
                            f"{debug.decode('utf-8', errors='replace')}",
                            remote=True, status=StatusCode.UNAVAILABLE)
            return
        if self._client:
            for call in [c for c in self._calls.values() if c.stream_id > last]:
                self._end_call(call, StatusCode.UNAVAILABLE,
                               "call refused by GOAWAY; safe to retry", (), EndCause.REFUSED)
        self._maybe_drained()

    _handlers: dict[type[h2.events.Event], Callable[[GrpcConnection, Any, float], None]] = {}


GrpcConnection._handlers = {
    h2.events.RequestReceived: GrpcConnection._on_request,
    h2.events.ResponseReceived: GrpcConnection._on_response,
    h2.events.TrailersReceived: GrpcConnection._on_trailers,
    h2.events.DataReceived: GrpcConnection._on_data,
    h2.events.StreamEnded: GrpcConnection._on_stream_ended,
    h2.events.StreamReset: GrpcConnection._on_reset,
    h2.events.WindowUpdated: GrpcConnection._on_window_updated,
    h2.events.RemoteSettingsChanged: GrpcConnection._on_settings_changed,
    h2.events.PingReceived: GrpcConnection._on_ping,
    h2.events.PingAckReceived: GrpcConnection._on_ping_ack,
    h2.events.ConnectionTerminated: GrpcConnection._on_terminated,
}
