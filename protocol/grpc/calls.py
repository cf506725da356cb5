"""The state of one gRPC-over-HTTP/2 connection and what happens to its calls.

Rules this file keeps: no I/O, no clock reads (times come in as ``now``). The
:class:`ConnectionState` is the part of :class:`protocol.grpc.GrpcConnection` the other parts
work on: the h2 machine and its settings, the budgets, the calls by stream, ending and
forgetting calls (every call ends here: :meth:`ConnectionState.end_call`,
:meth:`ConnectionState.fail_call`, :meth:`ConnectionState.terminate`), and handing queued
messages and statuses to HTTP/2 as flow control allows. Received frames are handled by
:class:`protocol.grpc.receive.Inbound`, pings by :class:`protocol.grpc.liveness.Liveness`, the
public commands by :class:`protocol.grpc.connection.GrpcConnection`.
"""

from __future__ import annotations

import h2.config
import h2.exceptions
import h2.settings

from protocol.grpc.h2_budgets import BudgetExceeded, FrameScanner, TokenBucket
from protocol.grpc.h2_tuned import DIRECT_DATA_MIN, TunedH2Connection
from protocol.grpc.liveness import Liveness
from protocol.grpc.metadata import Metadata, StatusCode, encode_grpc_message, encode_metadata
from protocol.grpc.types import (
    CallEnded,
    ConnectionTerminated,
    EndCause,
    Event,
    GrpcConfig,
    LocalProtocolError,
    SendBufferDrained,
)
from protocol.grpc.wire import ACCEPT_ENCODING, ERR, SUPPORTED_ENCODINGS, CallState, Phase

__all__ = ["ConnectionState"]


class ConnectionState:
    """A connection's state, its calls' endings and its send path (see the module)."""

    def __init__(self, config: GrpcConfig, liveness: Liveness) -> None:
        self.config = config
        self.liveness = liveness
        self.client = config.client_side
        # Outbound headers are built here from validated parts (lowercase
        # names, checked metadata), so h2's per-header outbound checks are
        # redundant work on every call; inbound validation stays on.
        self.h2 = TunedH2Connection(h2.config.H2Configuration(
            client_side=config.client_side, header_encoding=None,
            validate_outbound_headers=False, normalize_outbound_headers=False,
        ))
        self.authenticated = config.client_side or not config.require_authentication
        trusted = self.authenticated
        window, streams = config.limits(trusted)
        settings: dict[h2.settings.SettingCodes, int] = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: config.max_inbound_frame_size,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.max_header_list_size,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: streams,
        }
        if config.client_side:
            settings[h2.settings.SettingCodes.ENABLE_PUSH] = 0
        self.h2.local_settings = h2.settings.Settings(
            client=config.client_side, initial_values=settings)
        # Applied at once (PERF-NOTES): a big frame may arrive in the same
        # read as the peer's ack of our SETTINGS.
        self.h2.max_inbound_frame_size = config.max_inbound_frame_size
        # HPACK's own limit turns an oversized header block into a
        # connection error; keep it well above ours so that the per-call
        # check (RESOURCE_EXHAUSTED for that call alone) is what applies.
        self.h2.decoder.max_header_list_size = max(4 * config.max_header_list_size, 65_536)
        # The budgets: frames are checked as their headers arrive, before h2.
        budgets = config.budgets if trusted else config.unauthenticated_budgets
        self.scanner = FrameScanner(
            budgets, preface_size=0 if config.client_side else 24,
            max_data_frame_size=min(window, config.max_inbound_frame_size),
            max_header_list_size=config.max_header_list_size)
        self.resets = TokenBucket(budgets.reset_rate, budgets.reset_burst)
        self.partial_budget = config.partial_message_budget(trusted)
        # Bytes of incomplete messages held over all calls.
        self.partial_total = 0
        # Input held back by the frames-per-receive budget: a read, and
        # where in it the next receive starts (so it is never copied).
        self.backlog = b""
        self.backlog_at = 0
        # The connection receive window opened so far (RFC 9113's initial).
        self.connection_window = 65_535
        self.calls: dict[int, CallState] = {}
        # Bytes the caller consumed (``acknowledge``), handed to h2 when bytes are next taken to
        # write: one acknowledgement per stream per batch of messages rather than one each.
        self.acks: dict[int, int] = {}
        self.deadlines: list[tuple[float, int]] = []
        self.events: list[Event] = []
        self.initiated = False
        self.terminated = False
        self.goaway_sent = False
        self.goaway_received = False
        self.goaway_last_id = 2**31 - 1
        self.goaway_debug = b""
        # Calls with messages queued since the last data_to_send().
        self.dirty: dict[int, CallState] = {}
        # Calls this machine ended (CallEnded queued) since the last input.
        self.just_ended: set[int] = set()

    def open_connection_window(self) -> None:
        config = self.config
        target = (config.connection_window_size if self.authenticated
                  else min(config.unauthenticated_window_size, config.connection_window_size))
        if self.initiated and target > self.connection_window:
            self.h2.increment_flow_control_window(target - self.connection_window)
            self.connection_window = target

    def exceeded(self, violation: BudgetExceeded) -> None:
        """A peer went over a budget: GOAWAY (naming the last stream we
        took) with the violation's code, and every call ends."""
        self.backlog, self.backlog_at = b"", 0
        if self.terminated:
            return
        self.h2.close_connection(error_code=violation.error_code,
                                 additional_data=violation.reason.encode("ascii"))
        self.terminate(violation.error_code, violation.reason, remote=False,
                       status=StatusCode.UNAVAILABLE)

    def take_events(self) -> list[Event]:
        """Events caused by commands rather than input (e.g. the graceful
        drain finishing when the last call ends); :meth:`receive_data` and
        :meth:`handle_timeout` include these in what they return."""
        events = self.events
        self.events = []
        return events

    def hand_over(self) -> None:
        if self.dirty:
            dirty = self.dirty
            self.dirty = {}
            for call in dirty.values():
                if (call.pending or call.drain_owed) and call.stream_id in self.calls:
                    self.flush(call)

    def send_response_headers(self, call: CallState, metadata: Metadata,
                              encoding: str | None) -> None:
        headers = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", ACCEPT_ENCODING),
        ]
        if (encoding is not None and encoding != "identity"
            and encoding in SUPPORTED_ENCODINGS and encoding in call.accept_encodings):
            call.send_encoding = encoding
            headers.append((b"grpc-encoding", encoding.encode("ascii")))
        if metadata:
            headers.extend(encode_metadata(metadata))
        call.phase = Phase.RECEIVING
        try:
            self.h2.send_headers(call.stream_id, headers)
        except h2.exceptions.StreamClosedError:
            # Reset by the peer in the input being processed: the event
            # saying so is on its way.
            return
        self.liveness.sent_frames()

    def queue_status(self, call: CallState, code: StatusCode, message: str,
                     trailers: Metadata,
                     extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        headers: list[tuple[bytes, bytes]] = []
        if call.phase is Phase.WAITING_HEADERS:
            headers += [(b":status", b"200"), (b"content-type", b"application/grpc")]
        headers.append((b"grpc-status", b"%d" % code))
        if message:
            headers.append((b"grpc-message", encode_grpc_message(message).encode("ascii")))
        headers.extend(extra)
        if trailers:
            headers.extend(encode_metadata(trailers))
        call.phase = Phase.CLOSING
        call.local_closed = True
        if call.pending:
            call.pending_end = headers
        else:
            self.write_status(call, headers)

    def write_status(self, call: CallState, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            self.h2.send_headers(call.stream_id, headers, end_stream=True)
        except h2.exceptions.StreamClosedError:
            # The peer reset it in the input being processed; nothing to say.
            self.forget(call)
            return
        self.liveness.sent_frames()
        if not call.remote_closed:
            # Early status: tell the client to stop sending (PROTOCOL-HTTP2).
            self.reset_quietly(call.stream_id, ERR.NO_ERROR)
        self.forget(call)

    def send_final_goaway(self) -> None:
        self.liveness.drain_ping_over()
        self.goaway_last_id = self.h2.highest_inbound_stream_id
        self.h2.send_graceful_goaway(self.goaway_last_id, self.goaway_debug)
        self.maybe_drained()

    def ended_unseen(self, stream_id: int) -> bool:
        """Whether a command on this call is an answer to a stale event.

        One input can deliver a message and then end its call (the next
        message in the same DATA frame is over the limit, say): the caller
        may answer the MessageReceived before it reaches the CallEnded later
        in the same batch.  Such commands are dropped instead of refused; a
        command after the next input is misuse again.
        """
        if stream_id not in self.just_ended:
            return False
        call = self.calls.get(stream_id)
        return call is None or call.phase is Phase.CLOSING or call.local_closed

    def live_call(self, stream_id: int) -> CallState:
        call = self.calls.get(stream_id)
        if call is None or call.phase is Phase.CLOSING:
            raise LocalProtocolError(f"no live call on stream {stream_id}")
        return call

    def reset_quietly(self, stream_id: int, code: int) -> None:
        stream = self.h2.streams.get(stream_id)
        if stream is not None and not stream.closed:
            self.h2.reset_stream(stream_id, code)

    def forget(self, call: CallState) -> None:
        """Drop a call; return its unconsumed bytes to the connection window."""
        if self.calls.pop(call.stream_id, None) is None:
            return
        self.drop_partial(call)
        call.clear_queue()
        returned = call.unacked + self.acks.pop(call.stream_id, 0)
        if returned:
            self.h2.acknowledge_received_data(returned, call.stream_id)
            call.unacked = 0
        self.maybe_drained()

    def flush_acks(self) -> None:
        """Hand h2 the bytes acknowledged since the last write (its WINDOW_UPDATEs follow)."""
        if self.acks:
            acks, self.acks = self.acks, {}
            for stream_id, n in acks.items():
                self.h2.acknowledge_received_data(n, stream_id)

    def drop_partial(self, call: CallState) -> None:
        """Free what the call holds of an incomplete message."""
        self.partial_total -= call.have
        call.have = 0
        call.parts = []
        del call.buf[:]

    def end_call(self, call: CallState, status: StatusCode, message: str,
                 trailers: Metadata, cause: EndCause, reset_code: int | None = None) -> None:
        self.events.append(CallEnded(call.stream_id, status, message, trailers, cause,
                                     reset_code))
        self.just_ended.add(call.stream_id)
        self.forget(call)

    def fail_call(self, call: CallState, code: StatusCode, message: str,
                  cause: EndCause = EndCause.SYNTHESIZED) -> None:
        """End a call on our own initiative (not the peer's status): what we
        received on it is unacceptable, or its deadline passed."""
        call.discarding = True
        self.drop_partial(call)
        if self.client:
            self.reset_quietly(call.stream_id, ERR.CANCEL)
            self.end_call(call, code, message, (), cause)
            return
        call.clear_queue()
        call.pending_end = None
        self.events.append(CallEnded(call.stream_id, code, message, (), cause))
        self.just_ended.add(call.stream_id)
        self.queue_status(call, code, message, ())

    def maybe_drained(self) -> None:
        if (not self.calls and not self.terminated and self.liveness.drain_ping is None
            and (self.goaway_sent or self.goaway_received)):
            self.terminated = True
            self.events.append(ConnectionTerminated(
                0, "drained after GOAWAY", remote=self.goaway_received and not self.goaway_sent))

    def terminate(self, error_code: int, reason: str, *, remote: bool,
                  status: StatusCode) -> None:
        self.terminated = True
        for call in list(self.calls.values()):
            self.end_call(call, status, reason, (), EndCause.CONNECTION)
        self.events.append(ConnectionTerminated(error_code, reason, remote))

    def flush(self, call: CallState) -> None:
        """Hand queued bytes to h2 as far as windows allow, then any queued
        end; SendBufferDrained once the queue is empty."""
        try:
            self._flush_stream(call)
        except h2.exceptions.StreamClosedError:
            # The peer closed the stream in the input being processed (e.g.
            # a trailers-only rejection arriving with a window update); its
            # event ends the call, so what was queued is dropped.
            call.clear_queue()
            call.pending_end = None

    def _flush_stream(self, call: CallState) -> None:
        h2conn = self.h2
        stream_id = call.stream_id
        pending = call.pending
        # A message handed to HTTP/2, even in part, can no longer be withdrawn.
        key_by_part = call.key_by_part
        handed = False
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
                if key_by_part:
                    self._unkey(call, part)
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
            handed = True
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
        if handed:
            self.liveness.sent_frames()
        end = call.pending_end
        if end is not None:
            call.pending_end = None
            if end is True:
                h2conn.end_stream(stream_id)
            elif isinstance(end, list):
                self.write_status(call, end)
                return
        if call.drain_owed:
            # Emptied by withdrawals: drained once the peer takes bytes again (it just took
            # some, or its window is open), not before: a peer that reads nothing must not
            # look like one that drains.
            if not handed and h2conn.local_flow_control_window(stream_id) <= 0:
                return
            call.drain_owed = False
        self.events.append(SendBufferDrained(stream_id))

    @staticmethod
    def _unkey(call: CallState, part: bytes | memoryview) -> None:
        """``part`` goes to HTTP/2 (in whole or in part): its message, if keyed, is no longer
        withdrawable."""
        assert call.key_by_part is not None and call.queued_by_key is not None
        key = call.key_by_part.pop(id(part), None)
        if key is not None:
            del call.queued_by_key[key]

    def flush_all(self) -> None:
        for call in list(self.calls.values()):
            if (call.pending or call.drain_owed) and call.stream_id in self.calls:
                self.flush(call)
