"""h2, narrowly adjusted for gRPC: correctness where h2's defaults differ
from what gRPC needs, and speed where h2 does work on every frame that a
gRPC connection does not need.

Everything here leans on h2 4.4 internals (``_receive_frame``, the frame
dispatch table, stream state machines), so each adjustment is small, says
what it replaces, and is held to h2's own behaviour by
``tests/infx/transport/test_bigframes.py`` and ``tests/protocol/grpc/test_h2_tuned.py``.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.stream
from h2.utilities import (
    authority_from_headers, extract_method_header, is_informational_response, utf8_encode_headers,
)
from hpack import Decoder, Encoder
from hpack.table import HeaderTable
from hyperframe.frame import (
    DataFrame, Frame, GoAwayFrame, HeadersFrame, RstStreamFrame, WindowUpdateFrame,
)

if TYPE_CHECKING:
    from h2._typing import Buffer

_StreamInputs = h2.stream.StreamInputs

__all__ = ["DIRECT_DATA_MIN", "TunedFrameBuffer", "TunedH2Connection"]

#: DATA frames at least this large are queued by reference
#: (:meth:`TunedH2Connection.send_data_parts`) and received with one copy
#: (:class:`TunedFrameBuffer`); below it, copying is cheaper than the extra
#: buffers.
DIRECT_DATA_MIN = 64 * 1024
_ERR_REFUSED_STREAM = int(h2.errors.ErrorCodes.REFUSED_STREAM)
#: RFC 9113 4.1 frame header: 24-bit length (as 16 + 8 bits), type,
#: flags, stream id.
_FRAME_HEADER = struct.Struct(">HBBBL")
_DATA_TYPE = 0x0
_HEADERS_TYPE = 0x1
_CONTINUATION_TYPE = 0x9
_END_STREAM = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8


class _QuietDataFrame(DataFrame):
    """A DATA frame whose repr does not hex-dump its payload.

    h2 4.x formats ``repr(frame)`` for a trace log line on *every* received
    frame, logging enabled or not, and hyperframe's DATA repr hex-encodes
    the whole payload first (~4.7 ms per MiB; PERF-NOTES.md).  Received
    frames of the busy kinds are re-classed to a quiet subclass before h2
    sees them; h2 dispatches on the exact class, hence the extra
    dispatch-table entries.
    """

    def __repr__(self) -> str:
        return f"DataFrame(stream_id={self.stream_id}, {len(self.data)} bytes)"


class _QuietHeadersFrame(HeadersFrame):
    """A HEADERS frame with a cheap repr (a few microseconds per call)."""

    def __repr__(self) -> str:
        return f"HeadersFrame(stream_id={self.stream_id}, {len(self.data)} bytes)"


class _QuietWindowUpdateFrame(WindowUpdateFrame):
    """A WINDOW_UPDATE frame with a cheap repr (one per message or so)."""

    def __repr__(self) -> str:
        return f"WindowUpdateFrame(stream_id={self.stream_id}, +{self.window_increment})"


_QUIET_CLASS: dict[type[Frame], type[Frame]] = {
    DataFrame: _QuietDataFrame,
    HeadersFrame: _QuietHeadersFrame,
    WindowUpdateFrame: _QuietWindowUpdateFrame,
}


# ---------------------------------------------------------------------------
# Header blocks: the same few, again and again
#
# A gRPC connection codes nearly the same header lists on every call, and
# h2 pays for HPACK and its header checks each time (about half of a unary
# call's CPU).  Both are pure functions of what they are given plus, for
# HPACK, the dynamic table, so their results are kept and reused while the
# table has not changed since.

#: Header blocks up to this size have their coding kept; larger ones are
#: rare (big metadata) and would make the caches' memory unbounded in kind.
_CACHED_BLOCK_MAX = 1024
#: Entries per cache; a full cache starts again empty (a peer varying its
#: headers on every call only loses the speed-up).
_CACHE_ENTRIES = 64


class _CountingTable(HeaderTable):
    """An HPACK dynamic table that counts its changes.

    A header list whose coding did not change the table codes the same way
    again for as long as the count stays the same: every change (insertion,
    eviction, resize) goes through ``add`` or the ``maxsize`` setter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.changes += 1
        HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]


class _CachingEncoder(Encoder):
    """hpack's encoder, reusing the block of a header list it coded before
    without changing the table."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _CountingTable()
        self._blocks: dict[tuple[Any, ...], tuple[int, bytes]] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        table = self.header_table
        assert isinstance(table, _CountingTable)
        # A pending size update is coded into the next block; HeaderTuples
        # compare equal to plain tuples yet may have to stay unindexed, and
        # other values than bytes may compare equal yet code differently.
        if table.resized or not huffman or type(headers) is not list:
            return super().encode(headers, huffman)
        for header in headers:
            if (type(header) is not tuple or type(header[0]) is not bytes
                    or type(header[1]) is not bytes):
                return super().encode(headers, huffman)
        key = tuple(headers)
        changes = table.changes
        kept = self._blocks.get(key)
        if kept is not None and kept[0] == changes:
            return kept[1]
        block = super().encode(headers, huffman)
        if table.changes == changes and len(block) <= _CACHED_BLOCK_MAX:
            if len(self._blocks) >= _CACHE_ENTRIES:
                self._blocks.clear()
            self._blocks[key] = (changes, block)
        return block


class _CachingDecoder(Decoder):
    """hpack's decoder, reusing the header list of a block it decoded
    before without changing the table (under the same limits)."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _CountingTable()
        self._lists: dict[bytes, tuple[tuple[int, int, int], tuple[Any, ...]]] = {}

    def decode(self, data: bytes, raw: bool = False) -> Any:
        if not raw or type(data) is not bytes or len(data) > _CACHED_BLOCK_MAX:
            return super().decode(data, raw)
        table = self.header_table
        assert isinstance(table, _CountingTable)
        state = (table.changes, self.max_header_list_size, self.max_allowed_table_size)
        kept = self._lists.get(data)
        if kept is not None and kept[0] == state:
            return list(kept[1])
        headers = super().decode(data, raw=True)
        if table.changes == state[0]:
            if len(self._lists) >= _CACHE_ENTRIES:
                self._lists.clear()
            self._lists[data] = (state, tuple(headers))
        return headers


def _header_frames(stream_id: int, block: bytes, end_stream: bool, max_frame_size: int) -> bytes:
    """HEADERS (and CONTINUATION frames, if ``block`` needs them) carrying
    ``block``, serialised: what h2 builds as frame objects and then
    serialises."""
    flags = _END_STREAM if end_stream else 0
    if len(block) <= max_frame_size:
        size = len(block)
        return _FRAME_HEADER.pack(size >> 8, size & 0xFF, _HEADERS_TYPE,
                                  flags | _END_HEADERS, stream_id) + block
    frames: list[bytes] = []
    kind = _HEADERS_TYPE
    for start in range(0, len(block), max_frame_size):
        piece = block[start:start + max_frame_size]
        if start + max_frame_size >= len(block):
            flags |= _END_HEADERS
        frames += (_FRAME_HEADER.pack(len(piece) >> 8, len(piece) & 0xFF, kind, flags, stream_id),
                   piece)
        kind, flags = _CONTINUATION_TYPE, 0
    return b"".join(frames)


class _TunedStream(h2.stream.H2Stream):
    """h2's stream, skipping the checks of a received header list that
    passed them before unchanged (they depend on nothing else), and
    serialising header blocks straight to bytes."""

    #: Header lists (with their validation flags) that passed h2's checks
    #: unchanged on this connection; shared by its streams.
    passed: dict[tuple[Any, ...], None]

    def _process_received_headers(self, headers: Any, header_validation_flags: Any,
                                  header_encoding: bool | str | None) -> list[Any]:
        config = self.config
        if (header_encoding or not config.validate_inbound_headers
                or not config.normalize_inbound_headers):
            return super()._process_received_headers(headers, header_validation_flags,
                                                     header_encoding)
        given: list[Any] = list(headers)
        key = (tuple(given), header_validation_flags)
        if key in self.passed:
            return given
        checked: list[Any] = super()._process_received_headers(given, header_validation_flags,
                                                               header_encoding)
        if len(checked) == len(given) and all(a is b for a, b in zip(checked, given)):
            if len(self.passed) >= _CACHE_ENTRIES:
                self.passed.clear()
            self.passed[key] = None
        return checked

    def header_frames(self, headers: Any, encoder: Encoder, end_stream: bool) -> bytes:
        """What ``H2Stream.send_headers`` does (h2 4.4, outbound
        normalisation and validation off), in the same order and with the
        same errors, returning the serialised frames; an empty header list
        is refused up front."""
        headers = utf8_encode_headers(headers)
        if not headers:
            # h2 fails here with an IndexError after changing states; an
            # empty block is never what a caller meant.
            raise h2.exceptions.ProtocolError("Cannot send an empty header block.")
        machine = self.state_machine
        input_ = _StreamInputs.SEND_HEADERS
        if not machine.client and is_informational_response(headers):
            if end_stream:
                raise h2.exceptions.ProtocolError(
                    "Cannot set END_STREAM on informational responses.")
            input_ = _StreamInputs.SEND_INFORMATIONAL_HEADERS
        machine.process_input(input_)
        block = encoder.encode(headers)
        if end_stream:
            machine.process_input(_StreamInputs.SEND_END_STREAM)
        if machine.trailers_sent and not end_stream:
            raise h2.exceptions.ProtocolError("Trailers must have END_STREAM set.")
        if machine.client and self._authority is None:
            self._authority = authority_from_headers(headers)
        self.request_method = extract_method_header(headers)
        # The connection sets the frame size on every stream it creates.
        assert self.max_outbound_frame_size is not None
        return _header_frames(self.stream_id, block, end_stream, self.max_outbound_frame_size)


class TunedFrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, less most copies of a large DATA frame.

    h2 4.4 appends every read to one bytearray (a copy, and more when it
    grows), slices a frame's body out of it (another) and parses that into
    bytes (another).  The body of a large, unpadded DATA frame on a stream
    is instead collected as the reads themselves and joined once, when
    complete, into the frame's data.  Anything else, including anything
    malformed or out of place, takes h2's own path, so errors are h2's;
    the one difference is that an oversized large DATA frame is refused as
    soon as its header is in, where h2 would buffer all of it first.
    """

    def __init__(self, server: bool = False) -> None:
        super().__init__(server)
        # The large DATA frame being collected: its header, the pieces of
        # its body so far, and how many body bytes are still to come.
        self._header: bytes | None = None
        self._body: list[bytes | memoryview] = []
        self._body_left = 0

    def add_data(self, data: Buffer) -> None:
        if self._body_left:
            view = memoryview(data)
            take = min(self._body_left, len(view))
            self._body.append(view[:take])
            self._body_left -= take
            if take == len(view):
                return
            data = view[take:]
        super().add_data(data)

    def __next__(self) -> Frame:
        header = self._header
        if header is not None:
            if self._body_left:
                raise StopIteration
            body = b"".join(self._body)
            self._header = None
            self._body = []
            return self._data_frame(header, body)
        data = self._data
        if (len(data) >= 9 and data[3] == _DATA_TYPE
                and not data[4] & _PADDED and not self._headers_buffer
                and int.from_bytes(data[5:9], "big") & 0x7FFF_FFFF):
            length = int.from_bytes(data[:3], "big")
            if length >= DIRECT_DATA_MIN:
                self._validate_frame_length(length)
                header = bytes(data[:9])
                with memoryview(data) as view:
                    body = view[9:9 + length].tobytes()
                del data[:9 + length]
                if len(body) == length:
                    return self._data_frame(header, body)
                self._header = header
                self._body = [body]
                self._body_left = length - len(body)
                raise StopIteration
        return super().__next__()

    @staticmethod
    def _data_frame(header: bytes, body: bytes) -> Frame:
        frame, _ = Frame.parse_frame_header(memoryview(header))
        # What DataFrame.parse_body does for an unpadded frame, minus its
        # copy of the body.
        assert isinstance(frame, DataFrame)
        frame.data = body
        frame.body_len = len(body)
        return frame


class TunedH2Connection(h2.connection.H2Connection):
    """h2 with the adjustments gRPC needs and nothing else.

    1. The cheap DATA repr above.
    2. Graceful GOAWAY.  h2's connection state machine closes on any GOAWAY
       sent or received, which would forbid the drain gRPC requires (calls
       up to the last stream id must finish).  A GOAWAY with NO_ERROR is
       therefore sent and received here without touching h2's connection
       state; GOAWAYs carrying an error still go through h2 unchanged.
    3. A new stream past our SETTINGS_MAX_CONCURRENT_STREAMS is refused
       with RST_STREAM(REFUSED_STREAM), the stream error RFC 9113 5.1.2
       asks for, where h2 raises a connection error.  A client may exceed
       the limit innocently (calls started before our SETTINGS arrive), and
       a refused stream is safe for it to retry.
    4. Large DATA frames queued without copying (:meth:`send_data_parts`)
       and received with one copy instead of three (:class:`TunedFrameBuffer`).
    5. Header lists coded and checked once per connection, not per call
       (:class:`_CachingEncoder`, :class:`_CachingDecoder`,
       :class:`_TunedStream`), HEADERS and small DATA frames serialised
       without frame objects, and cheap reprs for the busy frame kinds.
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.incoming_buffer = TunedFrameBuffer(server=not config.client_side)
        for plain, quiet in _QUIET_CLASS.items():
            self._frame_dispatch_table[quiet] = self._frame_dispatch_table[plain]
        self.encoder = _CachingEncoder()
        self.decoder = _CachingDecoder()
        self.decoder.max_header_list_size = self.DEFAULT_MAX_HEADER_LIST_SIZE
        self._passed_headers: dict[tuple[Any, ...], None] = {}
        # Output queued ahead of _data_to_send: h2's bytes up to a gathered
        # DATA frame, then that frame's header and parts, in wire order.
        self._gathered: list[bytes | memoryview] = []

    def _receive_frame(self, frame: Frame) -> list[h2.events.Event]:
        quiet = _QUIET_CLASS.get(frame.__class__)
        if quiet is not None:
            frame.__class__ = quiet
        return super()._receive_frame(frame)

    def _begin_new_stream(self, stream_id: int,
                          allowed_ids: h2.connection.AllowedStreamIDs) -> h2.stream.H2Stream:
        stream = super()._begin_new_stream(stream_id, allowed_ids)
        stream.__class__ = _TunedStream
        assert isinstance(stream, _TunedStream)
        stream.passed = self._passed_headers
        return stream

    def _receive_headers_frame(
        self, frame: HeadersFrame,
    ) -> tuple[list[Frame], list[h2.events.Event]]:
        stream_id = frame.stream_id
        if (not self.config.client_side and stream_id not in self.streams
                and stream_id % 2 == 1 and stream_id > self.highest_inbound_stream_id
                and self.open_inbound_streams >= self.local_settings.max_concurrent_streams):
            # Decode anyway: the HPACK table must stay in step with the peer.
            h2.connection._decode_headers(self.decoder, frame.data)
            self.highest_inbound_stream_id = stream_id
            self._closed_streams[stream_id] = h2.stream.StreamClosedBy.SEND_RST_STREAM
            return [RstStreamFrame(stream_id, error_code=_ERR_REFUSED_STREAM)], []
        return super()._receive_headers_frame(frame)

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False,
                     priority_weight: int | None = None,
                     priority_depends_on: int | None = None,
                     priority_exclusive: bool | None = None) -> None:
        """h2's ``send_headers`` less its frame objects: the header frames
        are serialised straight into the output (see
        :meth:`_TunedStream.header_frames`).  Priorities and outbound
        header processing take h2's own path."""
        config = self.config
        if (priority_weight is not None or priority_depends_on is not None
                or priority_exclusive is not None or config.validate_outbound_headers
                or config.normalize_outbound_headers):
            super().send_headers(stream_id, headers, end_stream, priority_weight,
                                 priority_depends_on, priority_exclusive)
            return
        if stream_id not in self.streams:
            limit = self.remote_settings.max_concurrent_streams
            open_streams = self.open_outbound_streams
            if open_streams + 1 > limit:
                raise h2.exceptions.TooManyStreamsError(
                    f"Max outbound streams is {limit}, {open_streams} open")
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
        stream = self._get_or_create_stream(
            stream_id, h2.connection.AllowedStreamIDs(config.client_side))
        assert isinstance(stream, _TunedStream)
        self._data_to_send += stream.header_frames(headers, self.encoder, end_stream)

    def _receive_goaway_frame(
        self, frame: GoAwayFrame,
    ) -> tuple[list[Frame], list[h2.events.Event]]:
        if frame.error_code != 0:
            return super()._receive_goaway_frame(frame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def send_graceful_goaway(self, last_stream_id: int, debug_data: bytes) -> None:
        """Queue GOAWAY(NO_ERROR) and keep the connection usable for drain."""
        frame = GoAwayFrame(stream_id=0, last_stream_id=last_stream_id, error_code=0,
                            additional_data=debug_data)
        self._prepare_for_sending([frame])

    def send_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False,
                  pad_length: Any = None) -> None:
        """h2's ``send_data`` less its frame object: the same checks, state
        changes and window accounting, in the same order, with the frame
        serialised straight into the output.  Padding takes h2's path."""
        if pad_length is not None:
            super().send_data(stream_id, data, end_stream, pad_length)
            return
        size = len(data)
        if size > 0 and size > self.local_flow_control_window(stream_id):
            raise h2.exceptions.FlowControlError(
                f"Cannot send {size} bytes, flow control window is "
                f"{self.local_flow_control_window(stream_id)}")
        if size > self.max_outbound_frame_size:
            raise h2.exceptions.FrameTooLargeError(
                f"Cannot send frame size {size}, max frame size is {self.max_outbound_frame_size}")
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_DATA)
        stream = self.streams[stream_id]
        stream.state_machine.process_input(_StreamInputs.SEND_DATA)
        if end_stream:
            stream.state_machine.process_input(_StreamInputs.SEND_END_STREAM)
        stream.outbound_flow_control_window -= size
        self._data_to_send += _FRAME_HEADER.pack(size >> 8, size & 0xFF, _DATA_TYPE,
                                                 _END_STREAM if end_stream else 0, stream_id)
        self._data_to_send += data
        self.outbound_flow_control_window -= size

    def send_data_parts(self, stream_id: int, parts: list[bytes | memoryview],
                        size: int) -> None:
        """Queue one DATA frame (no flags, no padding) whose payload is
        ``parts`` (``size`` bytes in all), referencing them instead of
        copying them.

        ``send_data`` copies a payload three or four times on its way out
        (memoryview to bytes, frame serialisation, the output bytearray,
        ``data_to_send``): about half the cost of streaming 1 MiB messages
        (PERF-NOTES.md).  This does the bookkeeping ``send_data`` does, in
        the same order and with the same errors (h2 4.4), and hands the
        bytes over by reference; END_STREAM still goes through h2.
        """
        window = self.local_flow_control_window(stream_id)  # StreamClosedError
        if size > window:
            raise h2.exceptions.FlowControlError(
                f"Cannot send {size} bytes, flow control window is {window}")
        if size > self.max_outbound_frame_size:
            raise h2.exceptions.FrameTooLargeError(
                f"Cannot send frame size {size}, max frame size is "
                f"{self.max_outbound_frame_size}")
        self.state_machine.process_input(h2.connection.ConnectionInputs.SEND_DATA)
        stream = self.streams[stream_id]
        stream.state_machine.process_input(h2.stream.StreamInputs.SEND_DATA)
        stream.outbound_flow_control_window -= size
        self.outbound_flow_control_window -= size
        if self._data_to_send:
            self._gathered.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        self._gathered.append(_FRAME_HEADER.pack(size >> 8, size & 0xFF, _DATA_TYPE, 0, stream_id))
        self._gathered.extend(parts)

    def buffers_to_send(self) -> list[bytes | memoryview]:
        """Everything queued, in order, as buffers (empties the queue)."""
        buffers = self._gathered
        self._gathered = []
        if self._data_to_send:
            buffers.append(bytes(self._data_to_send))
            self._data_to_send = bytearray()
        return buffers

    def data_to_send(self, amount: int | None = None) -> bytes:
        if self._gathered:
            self._data_to_send[:0] = b"".join(self._gathered)
            self._gathered = []
        return super().data_to_send(amount)

    def clear_outbound_data_buffer(self) -> None:
        self._gathered = []
        super().clear_outbound_data_buffer()
