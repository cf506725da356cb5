"""What a gRPC connection does with each HTTP/2 event it receives.

Rules this file keeps: no I/O, no clock reads (``now`` is the last argument
of every handler); a peer that breaks the protocol never raises out of here:
the call (or the connection) ends with the status grpc/grpc
``doc/PROTOCOL-HTTP2.md`` prescribes.  Messages are reassembled from DATA
frames without copying a payload that arrives whole.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Callable
from typing import Any

import h2.events
import h2.settings

from protocol.grpc.calls import ConnectionCore
from protocol.grpc.h2_budgets import ENHANCE_YOUR_CALM, BudgetExceeded
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

__all__ = ["ReceivingConnection"]


class ReceivingConnection(ConnectionCore):
    """The received-event handlers of a connection (see the module)."""

    def _on_request(self, event: h2.events.RequestReceived, now: float) -> None:
        stream_id = event.stream_id
        assert stream_id is not None
        headers = list(event.headers or ())
        if self._goaway_sent and stream_id > self._goaway_last_id:
            self._reset_quietly(stream_id, ERR.REFUSED_STREAM)
            return
        fields = header_map(headers)
        call = CallState(stream_id, None)
        call.remote_closed = event.stream_ended is not None
        self._calls[stream_id] = call

        def reject(code: StatusCode, message: str, http_status: bytes = b"200",
                   extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
            call.discarding = True
            if http_status != b"200":
                out = [(b":status", http_status), (b"grpc-status", b"%d" % code),
                       (b"grpc-message", encode_grpc_message(message).encode("ascii"))]
                call.phase = Phase.CLOSING
                self._write_status(call, out)
            else:
                self._queue_status(call, code, message, (), extra)

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
        fields = header_map(headers)
        ended = event.stream_ended is not None
        if header_list_size(headers) > self.config.max_header_list_size:
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
            if encoding not in SUPPORTED_ENCODINGS:
                return self._fail_call(call, StatusCode.INTERNAL,
                                       f"response grpc-encoding {encoding!r} not supported")
            call.recv_encoding = None if encoding == "identity" else encoding
        try:
            metadata = decode_metadata(headers)
        except MetadataError as exc:
            return self._fail_call(call, StatusCode.INTERNAL, str(exc))
        call.phase = Phase.RECEIVING
        self._events.append(ResponseHeadersReceived(call.stream_id, metadata, call.recv_encoding))

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
        if header_list_size(headers) > self.config.max_header_list_size:
            return self._fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
                                   "trailer list too large")
        self._finish_from_headers(call, header_map(headers), headers, trailers_only=False)

    def _on_data(self, event: h2.events.DataReceived, now: float) -> None:
        stream_id = event.stream_id or 0
        flow = event.flow_controlled_length or 0
        call = self._calls.get(stream_id)
        if call is None or call.discarding or call.phase is Phase.CLOSING:
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

    def _on_stream_ended(self, event: h2.events.StreamEnded, now: float) -> None:
        call = self._calls.get(event.stream_id or 0)
        if call is None or call.discarding:
            return
        call.remote_closed = True
        if self._client:
            self._fail_call(call, StatusCode.INTERNAL, "stream ended without trailers")
        elif call.phase is not Phase.CLOSING:
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
            cause = EndCause.REFUSED if code == ERR.REFUSED_STREAM else EndCause.RESET
            self._end_call(call, status_for_reset(code),
                           f"stream reset by peer (HTTP/2 error {code})", (), cause, code)
        elif call.phase is Phase.CLOSING:
            self._forget(call)
        else:
            answered = call.phase is not Phase.WAITING_HEADERS
            self._end_call(call, StatusCode.CANCELLED, "cancelled by the client", (),
                           EndCause.RESET, code)
            # Rapid reset (CVE-2023-44487): each stream opened and reset
            # before we answered it cost a call set-up and nothing for the
            # peer, so they are rate-limited (Netty's idea; see h2_budgets).
            if not answered and not self._resets.take(now):
                self._exceeded(BudgetExceeded(ENHANCE_YOUR_CALM, "too many streams reset"))

    def _on_window_updated(self, event: h2.events.WindowUpdated, now: float) -> None:
        stream_id = event.stream_id or 0
        if (event.delta or 0) < TINY_WINDOW_UPDATE:
            # h2, grpc-core and grpc-go return at least 1 KiB at a time (or
            # a good part of the window): smaller increments are a flood,
            # but for the one grpc-core sends as each call starts (the 5
            # bytes of the prefix it reads first; a new stream per frame is
            # bounded by the stream and reset budgets).
            call = self._calls.get(stream_id) if stream_id else None
            if call is not None and not call.window_announced:
                call.window_announced = True
            else:
                violation = self._scanner.idle_frame(now)
                if violation is not None:
                    self._exceeded(violation)
                    return
        if stream_id == 0:
            self._flush_all()
        else:
            call = self._calls.get(stream_id)
            if call is not None and (call.pending or call.drain_owed):
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
                    self._h2.close_connection(error_code=ERR.ENHANCE_YOUR_CALM,
                                              additional_data=b"too_many_pings")
                    self._terminate(int(ERR.ENHANCE_YOUR_CALM), "too many pings",
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
        self._reset_quietly(call.stream_id, ERR.NO_ERROR)
        self._end_call(call, parsed[0], parsed[1], trailers, cause)

    def _end_largest_hoarder(self) -> None:
        """Incomplete messages hold more than the connection's budget: the
        call holding most of it ends RESOURCE_EXHAUSTED (its stream reset)."""
        hoarder = max(self._calls.values(), key=lambda c: c.have)
        self._fail_call(hoarder, StatusCode.RESOURCE_EXHAUSTED,
                        f"incomplete messages over the connection's budget of "
                        f"{self._partial_budget} bytes")

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
        events = self._events
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
            except CallFailed as exc:
                self._fail_call(call, exc.code, exc.message)
                return attributed
            # Earlier parts of this message were acknowledged on arrival.
            call.unacked += pos - start
            attributed += pos - start
            events.append(MessageReceived(stream_id, message, pos - start, call.msg_flag == 1))
        return attributed

    def _too_large(self, call: CallState, length: int) -> int:
        self._fail_call(call, StatusCode.RESOURCE_EXHAUSTED,
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

    _handlers: dict[type[h2.events.Event], Callable[[ReceivingConnection, Any, float], None]] = {}


ReceivingConnection._handlers = {
    h2.events.RequestReceived: ReceivingConnection._on_request,
    h2.events.ResponseReceived: ReceivingConnection._on_response,
    h2.events.TrailersReceived: ReceivingConnection._on_trailers,
    h2.events.DataReceived: ReceivingConnection._on_data,
    h2.events.StreamEnded: ReceivingConnection._on_stream_ended,
    h2.events.StreamReset: ReceivingConnection._on_reset,
    h2.events.WindowUpdated: ReceivingConnection._on_window_updated,
    h2.events.RemoteSettingsChanged: ReceivingConnection._on_settings_changed,
    h2.events.PingReceived: ReceivingConnection._on_ping,
    h2.events.PingAckReceived: ReceivingConnection._on_ping_ack,
    h2.events.ConnectionTerminated: ReceivingConnection._on_terminated,
}
