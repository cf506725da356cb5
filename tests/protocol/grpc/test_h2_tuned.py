"""The speed paths of ``protocol.grpc.h2_tuned`` for header blocks and received
frames: HPACK coding reused while the table is unchanged, received header
lists checked once per connection, header frames serialised straight to
bytes, and cheap reprs for the busy received frame kinds.

Each replaces work h2 or hpack does, so each is held to theirs: the same
blocks, tables, header lists (down to the tuple classes), wire bytes,
events, stream states and errors, step by step, for Hypothesis-chosen
sequences with frequent repeats (where the caches answer) and frequent
changes (where they must not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import h2.config
import h2.connection
import h2.exceptions
import h2.settings
import h2.stream
import hpack
import pytest
from h2.utilities import HeaderValidationFlags
from hpack import HeaderTuple, NeverIndexedHeaderTuple
from hyperframe.frame import ContinuationFrame, HeadersFrame
from hypothesis import example, given, settings, strategies as st

from protocol.grpc.h2_tuned import (
    TunedH2Connection,
    _CachingDecoder,
    _CachingEncoder,
    _header_frames,
    _TunedStream,
)

KiB = 1024
FAST = settings(max_examples=60, deadline=None)
SLOW = settings(max_examples=30, deadline=None)

Connection = h2.connection.H2Connection
KINDS: list[type[Connection]] = [TunedH2Connection, Connection]


def shape(value: object) -> object:
    """``value`` with the class of every container and object spelled out,
    so that a HeaderTuple does not pass for a NeverIndexedHeaderTuple (they
    compare equal) and events compare by their fields."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [shape(v) for v in value])
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    return (type(value).__name__, shape(vars(value)))


def outcome(action: Callable[[], object]) -> object:
    """What ``action`` returns, shaped, or the type of what it raises."""
    try:
        return shape(action())
    except Exception as exc:  # compared, never swallowed: a mismatch fails
        return type(exc)


# ---------------------------------------------------------------------------
# HPACK: _CachingEncoder and _CachingDecoder against hpack

NAMES = [b":method", b":path", b":status", b"content-type", b"grpc-timeout", b"x-trace",
         b"authorization"]
#: Static-table matches, literals that index, and a value too big for a
#: 100-byte table (adding it empties the table).
VALUES = [b"GET", b"POST", b"/", b"/svc/Method", b"200", b"application/grpc", b"1S", b"",
          b"abc", b"v" * 200]
#: Mostly plain pairs (the cached kind); the others take hpack's path or
#: change how a pair is indexed.
HEADER_KINDS = ["plain"] * 6 + ["never", "header", "sensitive", "insensitive"]
TABLE_SIZES = [0, 100, 4096]


def make_header(name: bytes, value: bytes, kind: str) -> tuple[Any, ...]:
    if kind == "never":
        return NeverIndexedHeaderTuple(name, value)
    if kind == "header":
        return HeaderTuple(name, value)
    if kind == "sensitive":
        return (name, value, True)
    if kind == "insensitive":
        return (name, value, False)
    return (name, value)


HEADER = st.builds(make_header, st.sampled_from(NAMES), st.sampled_from(VALUES),
                   st.sampled_from(HEADER_KINDS))


class Step(NamedTuple):
    """One step of an HPACK script: ``encode`` list ``which`` of the pool
    (Huffman-coded or not), ``resize`` the encoder's table, set a decoder
    limit (``allow``: table size, ``limit``: header list size), or
    ``replay`` an earlier block with its last ``cut`` bytes cut off."""

    kind: str
    which: int
    huffman: bool = True
    size: int = 0
    cut: int = 0


Script = tuple[list[list[tuple[Any, ...]]], list[Step]]


@st.composite
def hpack_scripts(draw: st.DrawFn, decoding: bool) -> Script:
    """A few header lists and a script that codes them over and over,
    resizing the table now and then (and, when decoding, moving the
    decoders' limits and replaying old blocks against a changed table)."""
    pool = draw(st.lists(st.lists(HEADER, max_size=5), min_size=1, max_size=5))
    kinds = ["encode"] * 6 + ["resize"] + (["allow", "limit", "replay"] if decoding else [])
    step = st.builds(Step, kind=st.sampled_from(kinds), which=st.integers(0, 30),
                     huffman=st.sampled_from([True] * 5 + [False]),
                     size=st.sampled_from(TABLE_SIZES), cut=st.sampled_from([0, 0, 0, 1, 3]))
    return pool, draw(st.lists(step, max_size=25))


def table_state(coder: hpack.Encoder | hpack.Decoder) -> tuple[object, ...]:
    table = coder.header_table
    return list(table.dynamic_entries), table.maxsize, table._current_size, table.resized


#: A list coded often enough to be cached, around table resizes.
REPEATS = ([[(b":method", b"GET"), (b"x-trace", b"abc")]],
           [Step("encode", 0)] * 3 + [Step("resize", 0, size=100), Step("encode", 0),
                                      Step("encode", 0), Step("resize", 0, size=0),
                                      Step("encode", 0), Step("encode", 0)])


@FAST
@given(script=hpack_scripts(decoding=False))
@example(script=REPEATS)
def test_caching_encoder_codes_every_list_as_hpack_does(
        script: Script) -> None:
    """Step by step, the same block and the same table as hpack's encoder,
    through repeats, resizes and headers that must not be indexed."""
    pool, steps = script
    ours, theirs = _CachingEncoder(), hpack.Encoder()
    for step in steps:
        if step.kind == "resize":
            ours.header_table_size = theirs.header_table_size = step.size
            continue
        headers = pool[step.which % len(pool)]
        assert (outcome(lambda: ours.encode(list(headers), step.huffman))
                == outcome(lambda: theirs.encode(list(headers), step.huffman)))
        assert table_state(ours) == table_state(theirs)
        assert ours.table_size_changes == theirs.table_size_changes


@FAST
@given(script=hpack_scripts(decoding=True), raw=st.sampled_from([True] * 4 + [False]))
# A cached list meeting a lower list limit, a changed table, a lower table limit.
@example(script=(REPEATS[0], [Step("encode", 0)] * 3 + [Step("limit", 0, size=0),
                                                        Step("replay", 2), Step("replay", 0)]),
         raw=True)
@example(script=([[(b"x-trace", b"abc")], [(b"content-type", b"abc")]],
                 [Step("encode", 0), Step("encode", 0), Step("encode", 1), Step("replay", 1)]),
         raw=True)
@example(script=(REPEATS[0], [Step("encode", 0)] * 2 + [Step("allow", 0, size=100),
                                                        Step("replay", 1)]),
         raw=True)
def test_caching_decoder_decodes_every_block_as_hpack_does(
        script: Script, raw: bool) -> None:
    """Blocks from hpack's encoder, and old blocks replayed whole or cut
    short after the table moved on, decode to the same header lists (tuple
    classes included), tables and errors as with hpack's decoder, whatever
    the decoders' limits."""
    pool, steps = script
    encoder = hpack.Encoder()
    ours, theirs = _CachingDecoder(), hpack.Decoder()
    blocks: list[bytes] = []
    for step in steps:
        if step.kind == "resize":
            encoder.header_table_size = step.size
            continue
        if step.kind == "allow":
            ours.max_allowed_table_size = theirs.max_allowed_table_size = step.size
            continue
        if step.kind == "limit":
            # 0 stands for 50; 50 and 100 refuse some lists here, 4096 none.
            ours.max_header_list_size = theirs.max_header_list_size = step.size or 50
            continue
        if step.kind == "replay" and blocks:
            block = blocks[step.which % len(blocks)]
            block = block[:len(block) - step.cut]
        else:
            block = encoder.encode(list(pool[step.which % len(pool)]), step.huffman)
            blocks.append(block)
        assert outcome(lambda: ours.decode(block, raw)) == outcome(lambda: theirs.decode(block, raw))
        assert table_state(ours) == table_state(theirs)


def test_a_cached_block_is_not_reused_for_an_equal_list_of_other_header_tuples() -> None:
    """HeaderTuples compare equal to plain tuples, but their class, not a
    third item, says whether they may be indexed: lists equal (or equal in
    content) to a cached one but made of them are coded afresh."""
    sensitive: list[Any] = [(b":method", b"GET"), (b"x-token", b"secret", True)]
    ours, theirs = _CachingEncoder(), hpack.Encoder()
    blocks = [ours.encode(list(sensitive)) for _ in range(3)]
    assert blocks[1] is blocks[0]  # the cache answered: this test exercises it
    assert blocks == [theirs.encode(list(sensitive))] * 3
    cases: list[tuple[list[Any], int]] = [
        # Equal in content: never indexed too (0x10), coded by hpack.
        ([(b":method", b"GET"), NeverIndexedHeaderTuple(b"x-token", b"secret")], 0x10),
        # Equal as tuples, yet indexable whatever its third item: 0x40.
        ([(b":method", b"GET"), HeaderTuple(b"x-token", b"secret", True)], 0x40),
    ]
    for headers, prefix in cases:
        block = ours.encode(list(headers))
        assert block == theirs.encode(list(headers))
        assert block[1] & 0xF0 == prefix
        assert table_state(ours) == table_state(theirs)


def test_values_other_than_bytes_are_coded_afresh() -> None:
    """1, True and 1.0 compare equal but hpack codes them as "1", "True"
    and "1.0": only lists of bytes are served from the cache."""
    ours, theirs = _CachingEncoder(), hpack.Encoder()
    for value in (1, 1, True, 1.0, "1", b"1", b"1"):
        headers: list[Any] = [(b"x", value)]
        assert ours.encode(headers) == theirs.encode(headers)
    assert table_state(ours) == table_state(theirs)


# ---------------------------------------------------------------------------
# Header frames serialised straight to bytes


@FAST
@given(size=st.integers(1, 200), frame_size=st.integers(1, 64), end_stream=st.booleans(),
       stream_id=st.sampled_from([1, 3, 2**31 - 1]))
@example(size=64, frame_size=64, end_stream=True, stream_id=1)
@example(size=128, frame_size=64, end_stream=True, stream_id=1)
@example(size=129, frame_size=64, end_stream=False, stream_id=1)
def test_header_frames_are_the_bytes_of_h2s_frame_objects(
        size: int, frame_size: int, end_stream: bool, stream_id: int) -> None:
    """Any block, any frame size (including exact multiples): what h2's
    ``_build_headers_frames`` builds, serialised."""
    block = bytes(range(256))[:size]
    frames: list[HeadersFrame | ContinuationFrame] = [HeadersFrame(stream_id, block[:frame_size])]
    frames += [ContinuationFrame(stream_id, block[i:i + frame_size])
               for i in range(frame_size, size, frame_size)]
    frames[-1].flags.add("END_HEADERS")
    if end_stream:
        frames[0].flags.add("END_STREAM")
    expected = b"".join(f.serialize() for f in frames)
    assert _header_frames(stream_id, block, end_stream, frame_size) == expected


# ---------------------------------------------------------------------------
# Two connections against two of h2's, in lockstep


def h2_config(client_side: bool, **extra: Any) -> h2.config.H2Configuration:
    return h2.config.H2Configuration(client_side=client_side, header_encoding=None,
                                     validate_outbound_headers=False,
                                     normalize_outbound_headers=False, **extra)


#: Bigger than two 16 KiB frames once Huffman-coded: HEADERS and two
#: CONTINUATIONs (and too big for any table, so adding it empties it).
BIG_VALUE = bytes(range(0x21, 0x7F)) * (40 * KiB // 94)
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/svc/Method"),
           (b":authority", b"infx")]
REQUEST_METADATA: list[list[Any]] = [
    [(b"content-type", b"application/grpc"), (b"te", b"trailers")],
    [(b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"1S")],
    # h2 joins cookies into one header: received lists it changes are not cached.
    [NeverIndexedHeaderTuple(b"authorization", b"Bearer t"), (b"cookie", b"a=1"),
     (b"x-trace", b"abc"), (b"cookie", b"b=2")],
    [(b"x-big", BIG_VALUE)],
]
RESPONSE_METADATA: list[list[Any]] = [
    [(b"content-type", b"application/grpc")],
    [(b"content-type", b"application/grpc"), (b"x-trace", b"abc")],
    [],
    [(b"x-big", BIG_VALUE)],
]
TRAILERS: list[list[Any]] = [
    [(b"grpc-status", b"0")],
    [(b"grpc-status", b"2"), (b"grpc-message", b"boom")],
    [(b"grpc-status", b"0"), NeverIndexedHeaderTuple(b"x-secret", b"s")],
    [(b"x-big", BIG_VALUE)],
]


class Peers:
    """A client and a server of one kind, joined by hand."""

    def __init__(self, kind: type[Connection], **server_config: Any) -> None:
        self.client = kind(h2_config(True))
        self.server = kind(h2_config(False, **server_config))
        self.opened: list[int] = []
        self.client.initiate_connection()
        self.server.initiate_connection()
        self.deliver()

    def deliver(self) -> list[object]:
        """Everything sent each way until both sides are quiet, and what it
        caused on the other side."""
        record: list[object] = []
        while True:
            quiet = True
            for sender, receiver in ((self.client, self.server), (self.server, self.client)):
                data = sender.data_to_send()
                if data:
                    quiet = False
                    record += [data, outcome(lambda: receiver.receive_data(data))]
            if quiet:
                return record

    def stream(self, pick: int) -> int:
        return self.opened[pick % len(self.opened)] if self.opened else 1

    def state(self) -> list[object]:
        return [(conn.state_machine.state,
                 {sid: (s.state_machine.state, s._authority, s.request_method)
                  for sid, s in conn.streams.items()},
                 table_state(conn.encoder), table_state(conn.decoder),
                 conn.max_outbound_frame_size, conn.outbound_flow_control_window)
                for conn in (self.client, self.server)]


class Op(NamedTuple):
    """One operation, read according to ``kind``; ``variant`` picks the
    headers, payload or setting, ``pick`` the stream, ``client`` the side."""

    kind: str
    client: bool
    pick: int
    variant: int
    end: bool


def perform(peers: Peers, op: Op) -> None:
    side = peers.client if op.client else peers.server
    stream_id = peers.stream(op.pick)
    if op.kind == "request":
        stream_id = peers.client.get_next_available_stream_id()
        peers.opened.append(stream_id)
        peers.client.send_headers(stream_id, REQUEST + REQUEST_METADATA[op.variant], op.end)
    elif op.kind == "informational":
        peers.server.send_headers(stream_id, [(b":status", b"100" if op.variant % 2 else b"103")],
                                  op.end)
    elif op.kind == "response":
        peers.server.send_headers(stream_id, [(b":status", b"200")] + RESPONSE_METADATA[op.variant],
                                  op.end)
    elif op.kind == "trailers":
        side.send_headers(stream_id, TRAILERS[op.variant], op.end)
    elif op.kind == "data":
        side.send_data(stream_id, b"d" * 37 * op.variant, op.end)
    elif op.kind == "window":
        side.increment_flow_control_window(1000 + op.variant, None if op.end else stream_id)
    elif op.kind == "table":
        side.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: TABLE_SIZES[op.variant % 3]})
    elif op.kind == "frame":
        side.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 16 * KiB + 100 * op.variant})
    return None


OPS = st.lists(st.builds(
    Op, kind=st.sampled_from(["request"] * 3 + ["response"] * 2 + [
        "informational", "trailers", "trailers", "data", "window", "table", "frame"]),
    client=st.booleans(), pick=st.integers(0, 7), variant=st.integers(0, 3), end=st.booleans(),
), max_size=16)

#: A full exchange: metadata cached and reused, 1xx, CONTINUATION both ways
#: across a frame size change and table resizes, trailers and data.
EXCHANGE = [
    Op("request", True, 0, 0, False), Op("request", True, 0, 0, False),
    Op("request", True, 0, 2, True), Op("request", True, 0, 2, True),
    Op("informational", False, 0, 0, False), Op("response", False, 0, 0, False),
    Op("data", True, 0, 2, False), Op("data", False, 0, 3, False),
    Op("window", True, 0, 1, False), Op("window", False, 1, 1, True),
    Op("trailers", True, 0, 0, True), Op("trailers", False, 0, 1, True),
    Op("frame", True, 0, 1, False), Op("table", True, 0, 1, False),
    Op("request", True, 0, 3, False), Op("response", False, 2, 3, False),
    Op("table", False, 0, 0, False), Op("request", True, 0, 0, True),
    Op("trailers", False, 2, 3, True), Op("response", False, 3, 0, True),
]


@SLOW
@given(ops=OPS)
@example(ops=EXCHANGE)
def test_tuned_peers_say_and_hear_what_h2_peers_do(ops: list[Op]) -> None:
    """Any sequence of requests, responses, 1xx, trailers, data, window and
    settings changes, in order or out of it: the same errors on sending,
    the same bytes on the wire, the same events (or errors) on receiving,
    and the same connection, stream and HPACK states after every step."""
    ours, theirs = Peers(TunedH2Connection), Peers(Connection)
    assert ours.state() == theirs.state()
    for op in ops:
        assert outcome(lambda: perform(ours, op)) == outcome(lambda: perform(theirs, op)), op
        assert ours.deliver() == theirs.deliver(), op
        assert ours.state() == theirs.state(), op


def two_streams_open(peers: Peers) -> None:
    for _ in range(2):
        perform(peers, Op("request", True, 0, 0, False))
    peers.deliver()


def send_on_a_closed_stream(p: Peers) -> None:
    p.client.send_headers(1, TRAILERS[0], end_stream=True)
    p.server.send_headers(1, [(b":status", b"200")], end_stream=True)
    p.deliver()
    p.client.send_headers(1, TRAILERS[0], end_stream=True)


def send_on_a_reset_stream(p: Peers) -> None:
    p.client.reset_stream(1)
    p.deliver()
    p.client.send_headers(1, TRAILERS[0], end_stream=True)


def send_trailers_without_end_stream(p: Peers) -> None:
    p.client.send_headers(1, TRAILERS[0], end_stream=False)


def send_informational_with_end_stream(p: Peers) -> None:
    p.server.send_headers(1, [(b":status", b"100")], end_stream=True)


def open_a_stream_from_the_server(p: Peers) -> None:
    p.server.send_headers(5, [(b":status", b"200")])


def open_a_stream_below_the_highest(p: Peers) -> None:
    p.client.send_headers(7, REQUEST)
    p.client.send_headers(5, REQUEST)


def open_too_many_streams(p: Peers) -> None:
    p.server.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2})
    p.deliver()
    p.client.send_headers(5, REQUEST)


@pytest.mark.parametrize("misuse, error", [
    (send_on_a_closed_stream, h2.exceptions.StreamClosedError),
    (send_on_a_reset_stream, h2.exceptions.StreamClosedError),
    (send_trailers_without_end_stream, h2.exceptions.ProtocolError),
    (send_informational_with_end_stream, h2.exceptions.ProtocolError),
    (open_a_stream_from_the_server, h2.exceptions.ProtocolError),
    (open_a_stream_below_the_highest, h2.exceptions.StreamIDTooLowError),
    (open_too_many_streams, h2.exceptions.TooManyStreamsError),
], ids=lambda v: getattr(v, "__name__", ""))
def test_send_headers_is_refused_as_h2_refuses_it(
        misuse: Callable[[Peers], None], error: type[Exception]) -> None:
    """The same exception, nothing sent that h2 would not send, and the
    same states afterwards (two requests, streams 1 and 3, open first)."""
    results = []
    for kind in KINDS:
        peers = Peers(kind)
        two_streams_open(peers)
        results.append((outcome(lambda: misuse(peers)), peers.deliver(), peers.state()))
    assert results[1][0] is error
    assert results[0] == results[1]


def data_after_end_stream(p: Peers) -> None:
    p.client.send_data(1, b"last", end_stream=True)
    p.client.send_data(1, b"more")


def data_on_a_stream_never_opened(p: Peers) -> None:
    p.client.send_data(9, b"x")


def empty_data_on_a_stream_never_opened(p: Peers) -> None:
    p.client.send_data(9, b"", end_stream=True)


def data_past_the_stream_window(p: Peers) -> None:
    p.server.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    p.deliver()
    p.client.send_data(1, b"x" * 11)


def data_past_the_frame_size(p: Peers) -> None:
    p.client.send_data(1, b"x" * (16 * KiB + 1))


def data_from_a_memoryview_then_padded(p: Peers) -> None:
    p.client.send_data(1, memoryview(b"view" * 10))
    p.client.send_data(3, b"padded", pad_length=3)
    p.client.send_data(1, b"", end_stream=True)


@pytest.mark.parametrize("action", [
    data_after_end_stream, data_on_a_stream_never_opened, empty_data_on_a_stream_never_opened,
    data_past_the_stream_window, data_past_the_frame_size, data_from_a_memoryview_then_padded,
], ids=lambda f: f.__name__)
def test_send_data_says_and_refuses_what_h2_does(action: Callable[[Peers], None]) -> None:
    """The direct DATA path: same outcome, bytes, states and windows."""
    results = []
    for kind in KINDS:
        peers = Peers(kind)
        two_streams_open(peers)
        results.append((outcome(lambda: action(peers)), peers.deliver(), peers.state(),
                        {sid: s.outbound_flow_control_window for sid, s in peers.client.streams.items()}))
    assert results[0] == results[1]


def test_an_empty_header_list_is_refused_before_anything_changes() -> None:
    """h2 4.4 fails on an empty header list with an IndexError from
    ``_build_headers_frames``; the direct path refuses it with a
    ProtocolError up front: nothing queued, stream states as they were."""
    plain, tuned = (Peers(kind) for kind in (Connection, TunedH2Connection))
    for peers in (plain, tuned):
        two_streams_open(peers)
    assert outcome(lambda: plain.client.send_headers(1, [], end_stream=True)) is IndexError
    before = tuned.state()
    assert outcome(lambda: tuned.client.send_headers(1, [], end_stream=True)) is h2.exceptions.ProtocolError
    assert tuned.client.data_to_send() == b""
    assert tuned.state() == before


# ---------------------------------------------------------------------------
# Received header lists: checked once, but only what passed


VALID = REQUEST + REQUEST_METADATA[0]
#: Requests one header away from VALID that h2 must refuse, and VALID where
#: it is not valid (as trailers, which may not carry pseudo-headers).
INVALID: dict[str, list[Any]] = {
    "uppercase-name": REQUEST + [(b"Content-Type", b"application/grpc"), (b"te", b"trailers")],
    "te-gzip": REQUEST + [(b"content-type", b"application/grpc"), (b"te", b"gzip")],
    "connection-header": REQUEST + [(b"content-type", b"application/grpc"),
                                    (b"connection", b"keep-alive")],
    "pseudo-after-regular": REQUEST[:3] + REQUEST_METADATA[0] + REQUEST[3:],
    "surrounding-whitespace": REQUEST + [(b"content-type", b"application/grpc "),
                                         (b"te", b"trailers")],
    "missing-path": REQUEST[:2] + REQUEST[3:] + REQUEST_METADATA[0],
    "as-trailers": VALID,
}


@pytest.mark.parametrize("name", list(INVALID), ids=list(INVALID))
def test_a_cached_valid_list_lets_no_invalid_one_through(name: str) -> None:
    """After VALID was received twice (the second time from the cache), an
    invalid list on the same connection ends it exactly as h2 does: the
    same ProtocolError, GOAWAY and states."""
    results = []
    for kind in KINDS:
        peers = Peers(kind)
        client = peers.client
        client.send_headers(1, VALID)
        client.send_headers(3, VALID)
        before = peers.deliver()
        if name == "as-trailers":
            client.send_headers(1, INVALID[name], end_stream=True)
        else:
            client.send_headers(5, INVALID[name])
        data = client.data_to_send()
        refused = outcome(lambda: peers.server.receive_data(data))
        results.append((before, refused, peers.deliver(), peers.state()))
        if isinstance(peers.server, TunedH2Connection):
            assert peers.server._passed_headers  # the cache was in play
    assert results[1][1] is h2.exceptions.ProtocolError
    assert results[0] == results[1]


def test_an_invalid_list_is_refused_every_time() -> None:
    """A refused list is never remembered as passed: refused again on the
    same stream, before and after VALID is cached, under the same flags."""
    peers = Peers(TunedH2Connection)
    peers.client.send_headers(1, VALID)
    peers.deliver()
    stream = peers.server.streams[1]
    assert isinstance(stream, _TunedStream)
    flags = HeaderValidationFlags(is_client=False, is_trailer=False, is_response_header=False,
                                  is_push_promise=False)
    for _ in range(2):
        for name, headers in INVALID.items():
            if name != "as-trailers":
                listed = [HeaderTuple(*h) for h in headers]
                with pytest.raises(h2.exceptions.ProtocolError):
                    stream._process_received_headers(listed, flags, None)
        assert stream._process_received_headers(list(VALID), flags, None) == VALID


# ---------------------------------------------------------------------------
# Quiet reprs of received frames


class TraceLog:
    """An h2 logger keeping the trace lines: h2 formats ``repr(frame)`` for
    one on every received frame, whether anyone reads it or not."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def debug(self, *args: object) -> None:
        pass

    def trace(self, fmt: str, *args: object) -> None:
        self.lines.append(fmt % args)


def test_received_frames_have_short_reprs_and_the_same_events() -> None:
    """DATA, HEADERS (with CONTINUATION) and WINDOW_UPDATE frames reach a
    tuned server as quiet frames: the same events as h2's, and trace lines
    that name the frame without dumping its payload."""
    payload = bytes(range(256)) * 60
    results, logs = [], []
    for kind in KINDS:
        log = TraceLog()
        peers = Peers(kind, logger=log)
        client = peers.client
        client.send_headers(1, REQUEST + REQUEST_METADATA[3])
        client.send_data(1, payload)
        client.send_data(1, payload[:100], end_stream=True)
        client.increment_flow_control_window(5000)
        client.increment_flow_control_window(7000, stream_id=1)
        log.lines.clear()
        results.append((outcome(lambda: peers.server.receive_data(client.data_to_send())),
                        peers.state()))
        logs.append([line for line in log.lines if line.startswith("Received frame:")])
    assert results[0] == results[1]
    assert len(logs[0]) == len(logs[1]) == 5
    assert all(payload[:10].hex() in line for line in logs[1][1:3])  # h2's, for contrast
    for line in logs[0]:
        assert len(line) < 80 and "stream_id=" in line, line
    assert logs[0][1:3] == ["Received frame: DataFrame(stream_id=1, 15360 bytes)",
                            "Received frame: DataFrame(stream_id=1, 100 bytes)"]
