"""What a gRPC connection does with each HTTP/2 event it receives: :class:`Inbound`.

Rules this file keeps: no I/O, no clock reads (``now`` is the last argument
of every handler); a peer that breaks the protocol never raises out of here:
the call (or the connection) ends with the status grpc/grpc
``doc/PROTOCOL-HTTP2.md`` prescribes, through the connection's state
(:class:`protocol.grpc.calls.ConnectionState`), where every call ends.  Messages are
reassembled from DATA frames without copying a payload that arrives whole; pings go to
:class:`protocol.grpc.liveness.Liveness`.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable
from typing import Any

import h2.events
import h2.settings

from protocol.grpc.calls import ConnectionState
from protocol.grpc.h2_budgets import ENHANCE_YOUR_CALM, BudgetExceeded
from protocol.grpc.liveness import Liveness
from protocol.grpc.metadata import (
    MetadataError,
    StatusCode,
    decode_metadata,
    decode_timeout,
    encode_grpc_message,
)
from protocol.grpc.types import (
    CallStarted,
    EndCause,
    GoAwayReceived,
    InputEnded,
    MessageReceived,
    PingAcknowledged,
    ResponseHeadersReceived,
)
from protocol.grpc.wire import (
    ACCEPT_ENCODING,
    ERR,
    PIECE_MIN,
    PREFIX,
    SUPPORTED_ENCODINGS,
    TINY_WINDOW_UPDATE,
    CallFailed,
    CallState,
    Phase,
    header_list_size,
    header_map,
    parse_status,
    status_for_http,
    status_for_reset,
)

__all__ = ["Inbound"]


class Inbound:
    """The received-event handlers of a connection (see the module)."""

    def __init__(self, state: ConnectionState, liveness: Liveness) -> None:
        self.config = state.config
        self._state = state
        self._liveness = liveness

    def handle(self, events: list[h2.events.Event], now: float) -> None:
        """Act on the HTTP/2 events of one receive, in order, until the connection ends."""
        handlers = self._handlers
        state = self._state
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(self, event, now)
            if state.terminated:
                break

    def _on_request(self, event: h2.events.RequestReceived, now: float) -> None:
        stream_id = event.stream_id
        assert stream_id is not None
        headers = list(event.headers or ())
        if self._state.goaway_sent and stream_id > self._state.goaway_last_id:
            self._state.reset_quietly(stream_id, ERR.REFUSED_STREAM)
            return
        fields = header_map(headers)
        call = CallState(stream_id, None)
        call.remote_closed = event.stream_ended is not None
        self._state.calls[stream_id] = call

        def reject(code: StatusCode, message: str, http_status: bytes = b"200",
                   extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
            call.discarding = True
            if http_status != b"200":
                out = [(b":status", http_status), (b"grpc-status", b"%d" % code),
                       (b"grpc-message", encode_grpc_message(message).encode("ascii"))]
                call.phase = Phase.CLOSING
                self._state.write_status(call, out)
            else:
                self._state.queue_status(call, code, message, (), extra)

        if header_list_size(headers) > self.config.max_header_list_size:
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
            if encoding not in SUPPORTED_ENCODINGS:
                return reject(StatusCode.UNIMPLEMENTED,
                              f"grpc-encoding {encoding!r} is not supported",
                              extra=((b"grpc-accept-encoding", ACCEPT_ENCODING),))
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
            heapq.heappush(self._state.deadlines, (deadline, stream_id))
        authority = fields.get(b":authority")
        self._state.events.append(CallStarted(
            stream_id, path.decode("utf-8", errors="replace"), metadata, deadline,
            None if authority is None else authority.decode("utf-8", errors="replace"),
            call.recv_encoding, call.accept_encodings))

    def _on_response(self, event: h2.events.ResponseReceived, now: float) -> None:
        call = self._state.calls.get(event.stream_id or 0)
        if call is None:
            return
        headers = list(event.headers or ())
        fields = header_map(headers)
        ended = event.stream_ended is not None
        if header_list_size(headers) > self.config.max_header_list_size:
            return self._state.fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
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
            return self._state.fail_call(call, code,
                                         f"unexpected HTTP status {http_status.decode('latin-1')}")
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            return self._state.fail_call(call, StatusCode.INTERNAL, "response is not application/grpc")
        encoding_raw = fields.get(b"grpc-encoding")
        if encoding_raw is not None:
            encoding = encoding_raw.decode("ascii", errors="replace")
            if encoding not in SUPPORTED_ENCODINGS:
                return self._state.fail_call(call, StatusCode.INTERNAL,
                                             f"response grpc-encoding {encoding!r} not supported")
            call.recv_encoding = None if encoding == "identity" else encoding
        try:
            metadata = decode_metadata(headers)
        except MetadataError as exc:
            return self._state.fail_call(call, StatusCode.INTERNAL, str(exc))
        call.phase = Phase.RECEIVING
        self._state.events.append(ResponseHeadersReceived(call.stream_id, metadata, call.recv_encoding))

    def _on_trailers(self, event: h2.events.TrailersReceived, now: float) -> None:
        call = self._state.calls.get(event.stream_id or 0)
        if call is None:
            return
        call.remote_closed = True
        if not self._state.client:
            # Request trailers are not gRPC; treat them as a half-close.
            self._state.events.append(InputEnded(call.stream_id))
            return
        headers = list(event.headers or ())
        if header_list_size(headers) > self.config.max_header_list_size:
            return self._state.fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                                         "trailer list too large")
        self._finish_from_headers(call, header_map(headers), headers, trailers_only=False)

    def _on_data(self, event: h2.events.DataReceived, now: float) -> None:
        stream_id = event.stream_id or 0
        flow = event.flow_controlled_length or 0
        state = self._state
        call = state.calls.get(stream_id)
        if call is None or call.discarding or call.phase is Phase.CLOSING:
            if flow:
                state.h2.acknowledge_received_data(flow, stream_id)
            return
        data = event.data or b""
        leftover = flow - self._reassemble(call, data)
        if state.partial_total > state.partial_budget:
            self._end_largest_hoarder()
        if leftover > 0:
            # Bytes of messages not complete yet (and padding) go back to
            # the window at once, so that a message larger than a window
            # still flows; the partial budget bounds what they can hold.
            state.h2.acknowledge_received_data(leftover, stream_id)

    def _on_stream_ended(self, event: h2.events.StreamEnded, now: float) -> None:
        call = self._state.calls.get(event.stream_id or 0)
        if call is None or call.discarding:
            return
        call.remote_closed = True
        if self._state.client:
            self._state.fail_call(call, StatusCode.INTERNAL, "stream ended without trailers")
        elif call.phase is not Phase.CLOSING:
            if call.in_body or call.buf:
                self._state.fail_call(call, StatusCode.INTERNAL, "half-closed inside a message")
            else:
                self._state.events.append(InputEnded(call.stream_id))

    def _on_reset(self, event: h2.events.StreamReset, now: float) -> None:
        call = self._state.calls.get(event.stream_id or 0)
        if call is None:
            return
        code = int(event.error_code or 0)
        if self._state.client:
            cause = EndCause.REFUSED if code == ERR.REFUSED_STREAM else EndCause.RESET
            self._state.end_call(call, status_for_reset(code),
                                 f"stream reset by peer (HTTP/2 error {code})", (), cause, code)
        elif call.phase is Phase.CLOSING:
            self._state.forget(call)
        else:
            answered = call.phase is not Phase.WAITING_HEADERS
            self._state.end_call(call, StatusCode.CANCELLED, "cancelled by the client", (),
                                 EndCause.RESET, code)
            # Rapid reset (CVE-2023-44487): each stream opened and reset
            # before we answered it cost a call set-up and nothing for the
            # peer, so they are rate-limited (Netty's idea; see h2_budgets).
            if not answered and not self._state.resets.take(now):
                self._state.exceeded(BudgetExceeded(ENHANCE_YOUR_CALM, "too many streams reset"))

    def _on_window_updated(self, event: h2.events.WindowUpdated, now: float) -> None:
        stream_id = event.stream_id or 0
        if (event.delta or 0) < TINY_WINDOW_UPDATE:
            # h2, grpc-core and grpc-go return at least 1 KiB at a time (or
            # a good part of the window): smaller increments are a flood,
            # but for the one grpc-core sends as each call starts (the 5
            # bytes of the prefix it reads first; a new stream per frame is
            # bounded by the stream and reset budgets).
            call = self._state.calls.get(stream_id) if stream_id else None
            if call is not None and not call.window_announced:
                call.window_announced = True
            else:
                violation = self._state.scanner.idle_frame(now)
                if violation is not None:
                    self._state.exceeded(violation)
                    return
        if stream_id == 0:
            self._state.flush_all()
        else:
            call = self._state.calls.get(stream_id)
            if call is not None and (call.pending or call.drain_owed):
                self._state.flush(call)

    def _on_settings_changed(self, event: h2.events.RemoteSettingsChanged, now: float) -> None:
        if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
            self._state.flush_all()

    def _on_ping(self, event: h2.events.PingReceived, now: float) -> None:
        if self._liveness.ping_received(now):
            state = self._state
            state.h2.close_connection(error_code=ERR.ENHANCE_YOUR_CALM, additional_data=b"too_many_pings")
            state.terminate(int(ERR.ENHANCE_YOUR_CALM), "too many pings", remote=False,
                            status=StatusCode.UNAVAILABLE)

    def _on_ping_ack(self, event: h2.events.PingAckReceived, now: float) -> None:
        payload = bytes(event.ping_data or b"")
        if payload == self._liveness.drain_ping:
            self._state.send_final_goaway()
            return
        round_trip = self._liveness.ack_received(payload, now)
        if round_trip is not None:
            self._state.events.append(PingAcknowledged(payload, round_trip))

    def _on_terminated(self, event: h2.events.ConnectionTerminated, now: float) -> None:
        code = int(event.error_code or 0)
        last = event.last_stream_id if event.last_stream_id is not None else 2**31 - 1
        debug = event.additional_data or b""
        self._state.goaway_received = True
        self._state.events.append(GoAwayReceived(last, code, debug))
        if code:
            self._state.terminate(code, f"GOAWAY from peer (HTTP/2 error {code}): "
                                  f"{debug.decode('utf-8', errors='replace')}",
                                  remote=True, status=StatusCode.UNAVAILABLE)
            return
        if self._state.client:
            for call in [c for c in self._state.calls.values() if c.stream_id > last]:
                self._state.end_call(call, StatusCode.UNAVAILABLE,
                                     "call refused by GOAWAY; safe to retry", (), EndCause.REFUSED)
        self._state.maybe_drained()

    def _finish_from_headers(self, call: CallState, fields: dict[bytes, bytes],
                             headers: list[tuple[bytes, bytes]], *, trailers_only: bool) -> None:
        parsed = parse_status(fields)
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
        self._state.reset_quietly(call.stream_id, ERR.NO_ERROR)
        self._state.end_call(call, parsed[0], parsed[1], trailers, cause)

    def _end_largest_hoarder(self) -> None:
        """Incomplete messages hold more than the connection's budget: the
        call holding most of it ends RESOURCE_EXHAUSTED (its stream reset)."""
        hoarder = max(self._state.calls.values(), key=lambda c: c.have)
        self._state.fail_call(hoarder, StatusCode.RESOURCE_EXHAUSTED,
                              f"incomplete messages over the connection's budget of "
                              f"{self._state.partial_budget} bytes")

    def _reassemble(self, call: CallState, data: bytes) -> int:
        """Cut ``data`` into messages; return how many of its bytes belong to
        messages delivered (those wait for the application's acknowledge;
        the bytes of a partial message are acknowledged at once so a message
        larger than the window still flows)."""
        pos = 0
        end = len(data)
        attributed = 0
        limit = self.config.max_receive_message_length
        stream_id = call.stream_id
        state = self._state
        events = state.events
        while pos < end:
            start = pos
            if not call.in_body:
                if not call.buf and end - pos >= 5:
                    flag, length = PREFIX.unpack_from(data, pos)
                    pos += 5
                    if length > limit:
                        return attributed + self._too_large(call, length)
                    if end - pos >= length:
                        # Whole message inside this frame: slice, no buffer.
                        payload = data[pos:pos + length]
                        pos += length
                        try:
                            message = self._decode(call, flag, payload)
                        except CallFailed as exc:
                            state.fail_call(call, exc.code, exc.message)
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
                flag, length = PREFIX.unpack_from(call.buf, 0)
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
                if take >= PIECE_MIN:
                    call.parts.append(data[pos:pos + take])
                elif take:
                    if not call.parts or type(call.parts[-1]) is not bytearray:
                        call.parts.append(bytearray())
                    call.parts[-1] += memoryview(data)[pos:pos + take]
                call.have += take
                state.partial_total += take
                pos += take
                if call.have < call.need:
                    break
                payload = b"".join(call.parts)
                state.partial_total -= call.have
                call.parts = []
                call.have = 0
            call.in_body = False
            try:
                message = self._decode(call, call.msg_flag, payload)
            except CallFailed as exc:
                state.fail_call(call, exc.code, exc.message)
                return attributed
            # Earlier parts of this message were acknowledged on arrival.
            call.unacked += pos - start
            attributed += pos - start
            events.append(MessageReceived(stream_id, message, pos - start, call.msg_flag == 1))
        return attributed

    def _too_large(self, call: CallState, length: int) -> int:
        self._state.fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                              f"received message larger than max ({length} vs. "
                              f"{self.config.max_receive_message_length})")
        return 0

    def _decode(self, call: CallState, flag: int, payload: bytes) -> bytes:
        if flag == 0:
            return payload
        if flag != 1:
            raise CallFailed(StatusCode.INTERNAL, f"invalid message flags {flag:#x}")
        if call.recv_encoding is None:
            raise CallFailed(StatusCode.INTERNAL,
                             "compressed message without a grpc-encoding")
        limit = self.config.max_receive_message_length
        decompressor = zlib.decompressobj(31)
        try:
            message = decompressor.decompress(payload, limit + 1)
        except zlib.error as exc:
            raise CallFailed(StatusCode.INTERNAL, f"gzip decompression failed: {exc}") from exc
        if len(message) > limit:
            raise CallFailed(StatusCode.RESOURCE_EXHAUSTED,
                             f"decompressed message larger than max ({limit})")
        if not decompressor.eof:
            raise CallFailed(StatusCode.INTERNAL, "truncated gzip message")
        return message

    _handlers: dict[type[h2.events.Event], Callable[[Inbound, Any, float], None]] = {}


Inbound._handlers = {
    h2.events.RequestReceived: Inbound._on_request,
    h2.events.ResponseReceived: Inbound._on_response,
    h2.events.TrailersReceived: Inbound._on_trailers,
    h2.events.DataReceived: Inbound._on_data,
    h2.events.StreamEnded: Inbound._on_stream_ended,
    h2.events.StreamReset: Inbound._on_reset,
    h2.events.WindowUpdated: Inbound._on_window_updated,
    h2.events.RemoteSettingsChanged: Inbound._on_settings_changed,
    h2.events.PingReceived: Inbound._on_ping,
    h2.events.PingAckReceived: Inbound._on_ping_ack,
    h2.events.ConnectionTerminated: Inbound._on_terminated,
}
