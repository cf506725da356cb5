"""gRPC over HTTP/2, client and server roles, as a sans-IO state machine.

Rules this file keeps: no sockets, no threads, no reactor, no clock reads.
Bytes go in through :meth:`GrpcConnection.receive_data`, events come out as
frozen dataclasses (``protocol/grpc/types.py``), bytes to write come out of
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

import heapq
import zlib
from collections.abc import Hashable

import h2.exceptions
import h2.settings

from protocol.grpc.calls import ConnectionState
from protocol.grpc.h2_budgets import ConnectionBudgets, TokenBucket
from protocol.grpc.h2_tuned import DIRECT_DATA_MIN
from protocol.grpc.metadata import (
    Metadata,
    MetadataError,
    MetadataValue,
    StatusCode,
    decode_grpc_message,
    decode_timeout,
    encode_grpc_message,
    encode_metadata,
    encode_timeout,
)
from protocol.grpc.liveness import KeepaliveDue, Liveness
from protocol.grpc.receive import Inbound
from protocol.grpc.types import (
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
from protocol.grpc.wire import (
    ACCEPT_ENCODING,
    ERR,
    PREFIX,
    SUPPORTED_ENCODINGS,
    CallState,
    Phase,
    checked_metadata,
    status_for_http,
    status_for_reset,
)

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

    Its parts: :class:`ConnectionState` (h2, the calls, their endings, the send path),
    :class:`Inbound` (what each received HTTP/2 event does) and :class:`Liveness` (pings,
    keepalive, the drain ping); the commands are here.
    """

    def __init__(self, config: GrpcConfig) -> None:
        self.config = config
        self._liveness = liveness = Liveness(config)
        self._state = state = ConnectionState(config, liveness)
        self._inbound = Inbound(state, liveness)
        # The parts of the state every command reads, held here too (never rebound there).
        self._h2 = state.h2
        self._calls = state.calls
        self._client = state.client

    def take_events(self) -> list[Event]:
        """Events caused by commands rather than input (e.g. the graceful
        drain finishing when the last call ends); :meth:`receive_data` and
        :meth:`handle_timeout` include these in what they return."""
        return self._state.take_events()

    def initiate(self, now: float) -> None:
        """Queue the connection preface and our SETTINGS; call once first."""
        if self._state.initiated:
            raise LocalProtocolError("connection already initiated")
        self._state.initiated = True
        self._liveness.received(now)
        self._h2.initiate_connection()
        self._state.open_connection_window()

    def authenticate(self) -> None:
        """Server: a call on this connection passed authentication, so the
        peer gets the full limits (streams, windows, partial budget) from now
        on; new SETTINGS and a connection WINDOW_UPDATE tell it so.  Idempotent.

        Until then a message is bounded by the partial budget (one small
        window) rather than refused by its length prefix: a legitimate first
        message may arrive in the read that also carries the credentials."""
        if self._state.authenticated or self._state.terminated:
            return
        self._state.authenticated = True
        config = self.config
        self._state.partial_budget = config.partial_message_budget()
        # Allow the larger frames at once: the peer may use the new window
        # as soon as it has our SETTINGS, before we see its ack.
        self._state.scanner.max_data_frame_size = min(config.initial_window_size,
                                                      config.max_inbound_frame_size)
        self._state.scanner.use(config.budgets)
        self._state.resets = TokenBucket(config.budgets.reset_rate, config.budgets.reset_burst)
        self._h2.update_settings({
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: config.initial_window_size,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.max_concurrent_streams,
        })
        self._state.open_connection_window()

    @property
    def authenticated(self) -> bool:
        """Whether the full limits apply (see :meth:`authenticate`)."""
        return self._state.authenticated

    def output_stalled(self) -> None:
        """The transport stopped taking our bytes (the peer is not reading):
        control frames that need a reply count against
        ``budgets.max_stalled_control_replies`` until :meth:`output_drained`."""
        self._state.scanner.output_stalled = True

    def output_drained(self) -> None:
        """The transport took what we wrote again."""
        self._state.scanner.output_stalled = False
        self._state.scanner.stalled_replies = 0

    def receive_data(self, data: bytes, now: float) -> list[Event]:
        """Feed bytes read from the transport; return what they caused.

        At most ``budgets.max_frames_per_receive`` frames are processed; the
        rest is kept (:attr:`has_pending_input`) for :meth:`receive_pending`,
        and the caller should stop reading until it is gone.
        """
        if self._state.terminated:
            return self.take_events()
        if self.has_pending_input:
            # More input while some is held back (a TLS layer may deliver
            # several records at once): it queues behind.
            self._state.backlog = self._state.backlog[self._state.backlog_at:] + data
            self._state.backlog_at = 0
            return self.receive_pending(now)
        return self._receive(data, 0, now)

    @property
    def has_pending_input(self) -> bool:
        """Whether received bytes wait for :meth:`receive_pending`."""
        return len(self._state.backlog) > self._state.backlog_at and not self._state.terminated

    def receive_pending(self, now: float) -> list[Event]:
        """Process the next part of the input kept by :meth:`receive_data`."""
        if not self.has_pending_input:
            return self.take_events()
        data, start = self._state.backlog, self._state.backlog_at
        self._state.backlog, self._state.backlog_at = b"", 0
        return self._receive(data, start, now)

    def _receive(self, data: bytes, start: int, now: float) -> list[Event]:
        self._state.just_ended.clear()
        self._liveness.received(now)
        view: bytes | memoryview = memoryview(data)[start:] if start else data
        consumed, violation = self._state.scanner.scan(view, now)
        if consumed < len(view):
            if violation is None:
                self._state.backlog, self._state.backlog_at = data, start + consumed
            view = memoryview(view)[:consumed]
        if view:
            try:
                h2_events = self._h2.receive_data(view)
            except h2.exceptions.ProtocolError as exc:
                # h2 has queued a GOAWAY with the right code already.
                code = getattr(exc, "error_code", ERR.PROTOCOL_ERROR)
                self._state.backlog, self._state.backlog_at = b"", 0
                self._state.terminate(int(code), f"HTTP/2 protocol error: {exc}", remote=False,
                                      status=StatusCode.UNAVAILABLE)
                return self.take_events()
            self._inbound.handle(h2_events, now)
        if violation is not None:
            self._state.exceeded(violation)
        return self.take_events()

    def data_to_send(self) -> bytes:
        """Bytes to write to the transport now (empties the buffer).

        Queued messages go out here, as far as flow control allows; this may
        cause events (:meth:`take_events`): SendBufferDrained for calls whose
        queue emptied, and ends of calls whose status was waiting.
        """
        self._state.flush_acks()
        self._state.hand_over()
        return self._h2.data_to_send()

    def buffers_to_send(self) -> list[bytes | memoryview]:
        """What :meth:`data_to_send` returns, as a list of buffers to write
        in order (empties the buffer): large message payloads come out as
        the very objects given to :meth:`send_message`, uncopied, for a
        gathering write (``writeSequence``, ``sendmsg``)."""
        self._state.flush_acks()
        self._state.hand_over()
        return self._h2.buffers_to_send()

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must next be called (None: never)."""
        if self._state.terminated:
            return None
        heap = self._state.deadlines
        calls = self._calls
        while heap:
            deadline, stream_id = heap[0]
            call = calls.get(stream_id)
            if call is not None and call.deadline == deadline:
                break
            heapq.heappop(heap)
        best = heap[0][0] if heap else None
        timer = self._liveness.timer()
        if timer is not None and (best is None or timer < best):
            best = timer
        return best

    def handle_timeout(self, now: float) -> list[Event]:
        """Expire call deadlines and keepalive timers due at ``now``."""
        if self._state.terminated:
            return self.take_events()
        self._state.just_ended.clear()
        heap = self._state.deadlines
        while heap and heap[0][0] <= now:
            deadline, stream_id = heapq.heappop(heap)
            call = self._calls.get(stream_id)
            if call is None or call.deadline != deadline:
                continue
            if call.phase is Phase.CLOSING:
                # Our status is written; only flow control holds it back.
                self._state.reset_quietly(stream_id, ERR.CANCEL)
                self._state.forget(call)
            else:
                # Server: status DEADLINE_EXCEEDED then RST_STREAM, as
                # grpc-core does, so a client whose own timer is late still
                # sees DEADLINE_EXCEEDED; client: RST_STREAM(CANCEL).
                self._state.fail_call(call, StatusCode.DEADLINE_EXCEEDED, "deadline exceeded",
                                      EndCause.DEADLINE)
        drain_ping_deadline = self._liveness.drain_ping_deadline
        if drain_ping_deadline is not None and now >= drain_ping_deadline:
            self._state.send_final_goaway()
        if self._state.terminated:
            # The last call of a draining connection just expired: no keepalive.
            return self.take_events()
        due = self._liveness.keepalive_due(now)
        if due is KeepaliveDue.TIMEOUT:
            self._state.terminate(int(ERR.NO_ERROR), "keepalive timeout", remote=True,
                                  status=StatusCode.UNAVAILABLE)
        elif due is KeepaliveDue.PING:
            self._liveness.keepalive_sent(self.ping(now), now)
        return self.take_events()

    def connection_lost(self, reason: str = "connection lost") -> list[Event]:
        """The transport closed: every live call ends UNAVAILABLE."""
        if not self._state.terminated:
            self._state.terminate(int(ERR.NO_ERROR), reason, remote=True,
                                  status=StatusCode.UNAVAILABLE)
        return self.take_events()

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
        if encoding is not None and encoding not in SUPPORTED_ENCODINGS:
            raise LocalProtocolError(f"unsupported encoding {encoding!r}")
        metadata = checked_metadata(metadata)
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
            (b"grpc-accept-encoding", ACCEPT_ENCODING),
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
        self._liveness.sent_frames()
        call = CallState(stream_id, deadline)
        call.send_encoding = encoding if encoding != "identity" else None
        self._calls[stream_id] = call
        if deadline is not None:
            heapq.heappush(self._state.deadlines, (deadline, stream_id))
        return stream_id

    def end_stream(self, stream_id: int) -> None:
        """Client: half-close (no more request messages); sent after any
        queued messages."""
        if self._state.ended_unseen(stream_id):
            return
        call = self._state.live_call(stream_id)
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
        if self._state.ended_unseen(stream_id):
            return
        call = self._calls.get(stream_id)
        if call is None:
            raise LocalProtocolError(f"no live call on stream {stream_id}")
        self._state.reset_quietly(stream_id, ERR.CANCEL)
        self._state.forget(call)

    def send_initial_metadata(
        self, stream_id: int, metadata: Metadata = (), *, encoding: str | None = None,
    ) -> None:
        """Server: send response headers now (otherwise they go out with the
        first message).  ``encoding="gzip"`` lets ``send_message(...,
        compress=True)`` compress; ignored if the client does not accept it."""
        if self._state.ended_unseen(stream_id):
            return
        call = self._state.live_call(stream_id)
        if self._client:
            raise LocalProtocolError("send_initial_metadata is a server command")
        if call.phase is not Phase.WAITING_HEADERS:
            raise LocalProtocolError(f"headers already sent on stream {stream_id}")
        metadata = checked_metadata(metadata)
        self._state.send_response_headers(call, metadata, encoding)

    def send_status(
        self, stream_id: int, code: StatusCode, message: str = "", trailers: Metadata = (),
    ) -> None:
        """Server: end the call with a status.  Trailers-only if no headers
        were sent; queued after any pending messages; followed by
        RST_STREAM(NO_ERROR) if the client had not half-closed."""
        if self._state.ended_unseen(stream_id):
            return
        call = self._state.live_call(stream_id)
        if self._client:
            raise LocalProtocolError("send_status is a server command; use end_stream")
        trailers = checked_metadata(trailers)
        self._state.queue_status(call, StatusCode(code), message, trailers)

    def send_message(self, stream_id: int, data: bytes, *, compress: bool = False,
                     key: Hashable | None = None) -> None:
        """Send one message.  It is handed to HTTP/2 at the next
        :meth:`data_to_send` (so a burst of messages shares DATA frames) and
        stays queued while flow control forbids sending.

        ``compress`` compresses with the call's encoding when it has one.
        ``key`` (unique among the call's queued messages) lets
        :meth:`withdraw_message` take the message back while none of it was
        handed to HTTP/2.
        Raises :class:`MessageTooLarge` over ``max_send_message_length``.
        """
        if self._state.ended_unseen(stream_id):
            return
        call = self._calls.get(stream_id)
        if call is None or call.local_closed:
            raise LocalProtocolError(f"stream {stream_id} cannot send messages")
        limit = self.config.max_send_message_length
        if limit is not None and len(data) > limit:
            raise MessageTooLarge(
                 f"message of {len(data)} bytes is over the send limit of {limit}")
        if key is not None and call.queued_by_key is not None and key in call.queued_by_key:
            raise LocalProtocolError(f"a message keyed {key!r} is queued on stream {stream_id} already")
        if call.phase is Phase.WAITING_HEADERS and not self._client:
            self._state.send_response_headers(call, (), None)
        flag = 0
        if compress and call.send_encoding == "gzip":
            data = zlib.compress(data, 6, 31)
            flag = 1
        # Queued until data_to_send(): messages sent in a burst then share
        # DATA frames, which is most of the cost for small messages.  A large
        # payload stays a separate (immutable) buffer that is written by
        # reference, never joined with its prefix.
        first: bytes
        if len(data) >= DIRECT_DATA_MIN:
            first = PREFIX.pack(flag, len(data))
            call.pending.append(first)
            call.pending.append(data if type(data) is bytes else bytes(data))
        else:
            first = PREFIX.pack(flag, len(data)) + data
            call.pending.append(first)
        call.pending_bytes += 5 + len(data)
        if key is not None:
            if call.queued_by_key is None or call.key_by_part is None:
                 call.queued_by_key, call.key_by_part = {}, {}
            call.queued_by_key[key] = first
            call.key_by_part[id(first)] = key
        self._state.dirty[stream_id] = call

    def withdraw_message(self, stream_id: int, key: Hashable) -> bool:
        """Take back the message queued with ``key``, if none of its bytes went to
        HTTP/2 yet; whether it did (False for an unknown key, a message handed over
        in whole or in part, or a call that ended).

        A queue emptied this way is not a drained one: SendBufferDrained follows
        only once the peer's window for the call is open (it may read again).
        """
        call = self._calls.get(stream_id)
        if call is None or call.queued_by_key is None or call.key_by_part is None:
            return False
        first = call.queued_by_key.pop(key, None)
        if first is None:
            return False
        del call.key_by_part[id(first)]
        pending = call.pending
        index = next(i for i, part in enumerate(pending) if part is first)
        # A large message is its prefix and then its payload (see send_message); the prefix
        # of any other message is joined with its payload.
        count = 2 if len(first) == PREFIX.size and PREFIX.unpack(first)[1] else 1
        for _ in range(count):
            call.pending_bytes -= len(pending[index])
            del pending[index]
        if not pending:
            call.drain_owed = True
            self._state.dirty[stream_id] = call
        return True

    def buffered_amount(self, stream_id: int) -> int:
        """Bytes of this call's messages not yet handed to HTTP/2 (queued
        until data_to_send() or waiting for flow-control window); 0 for
        unknown or finished calls."""
        call = self._calls.get(stream_id)
        return 0 if call is None else call.pending_bytes

    def acknowledge(self, stream_id: int, n: int) -> None:
        """The caller consumed ``n`` flow-controlled bytes of this call (see
        :attr:`MessageReceived.flow_controlled_length`); reopens windows (in
        the bytes of the next :meth:`data_to_send`, once per stream however
        many messages were acknowledged). Acknowledging on an ended call is a no-op: its bytes were returned
        to the connection when it ended."""
        call = self._calls.get(stream_id)
        if call is None or n <= 0:
            return
        n = min(n, call.unacked)
        if n:
            call.unacked -= n
            self._state.acks[stream_id] = self._state.acks.get(stream_id, 0) + n

    def ping(self, now: float) -> bytes:
        """Send a PING; returns its 8-byte payload (see PingAcknowledged)."""
        if self._state.terminated:
            raise LocalProtocolError("connection terminated")
        payload = self._liveness.ping_sent(now)
        self._h2.ping(payload)
        return payload

    def go_away(self, error_code: int = 0, debug_data: bytes = b"", *, now: float) -> list[Event]:
        """Stop accepting calls.  With error_code 0 this is a graceful drain:
        calls already started finish, then ConnectionTerminated(0) follows;
        otherwise every call ends now (UNAVAILABLE).

        A server drains in two phases (RFC 9113 6.8, as grpc-core does):
        a GOAWAY that refuses nothing with a PING behind it, then, on the
        PING's ack (or ``GOAWAY_ACK_TIMEOUT`` after ``now``), the GOAWAY naming the last stream it serves.
        Calls the client started before it saw the first GOAWAY arrive
        before the ack and are served rather than refused."""
        if self._state.terminated:
            return self.take_events()
        if error_code:
            self._h2.close_connection(error_code=error_code, additional_data=debug_data)
            self._state.terminate(error_code, "local GOAWAY", remote=False,
                 status=StatusCode.UNAVAILABLE)
        elif not self._state.goaway_sent:
            self._state.goaway_sent = True
            self._state.goaway_debug = debug_data
            if self._client:
                 # A client never accepts streams, so its last id is 0.
                 self._state.goaway_last_id = 0
                 self._h2.send_graceful_goaway(0, debug_data)
            else:
                 self._h2.send_graceful_goaway(2**31 - 1, debug_data)
                 self._h2.ping(self._liveness.drain_ping_sent(now, GOAWAY_ACK_TIMEOUT))
            self._state.maybe_drained()
        return self.take_events()

    @property
    def active_calls(self) -> int:
        """Calls currently open on this connection."""
        return len(self._calls)

    @property
    def accepting_calls(self) -> bool:
        """False once a GOAWAY was sent or received or the connection ended."""
        return not (self._state.terminated or self._state.goaway_sent or self._state.goaway_received)

    @property
    def max_concurrent_calls(self) -> int:
        """The peer's SETTINGS_MAX_CONCURRENT_STREAMS (client side)."""
        return int(self._h2.remote_settings.max_concurrent_streams)
