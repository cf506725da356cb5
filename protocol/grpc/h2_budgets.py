"""Per-connection budgets against hostile HTTP/2 peers, as pure pieces.

Rules this file keeps: no I/O, no clock reads (``now`` is an argument), no
h2 objects.  :class:`FrameScanner` reads the 9-byte frame headers of the
received byte stream *before* h2 parses anything, so a frame that is over a
budget is refused as soon as its header arrives and never buffered; it also
says where to stop so that one call feeds at most a bounded number of frames
to h2 (fairness between connections).  :class:`TokenBucket` is the rate
limit the budgets share.  :class:`GrpcConnection` (``protocol/grpc/connection.py``)
owns one scanner and turns a :class:`BudgetExceeded` into a GOAWAY with
its error code.

Where the ideas come from (ideas, not code): golang/net's http2 server
bounds the control frames it has queued but not written
(``maxQueuedControlFrames``).  Against rapid reset (CVE-2023-44487) it
bounds the handlers running at once to the stream limit and ends the
connection when the requests queued behind them grow too many; nginx ends
a connection that opens too many streams in one event-loop iteration;
Netty bounds RST_STREAM frames per time window, which is the shape used
here (a token bucket on the caller's clock), because a stream reset before
we answered it is exactly the work the attack makes us do for nothing.
grpc-core bounds pings with strikes; Tomcat's "overhead protection" counts
frames that make it work for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "UNAUTHENTICATED_BUDGETS", "BudgetExceeded", "ConnectionBudgets", "FrameScanner",
    "TokenBucket", "max_header_block_size",
]

KiB = 1024
_DATA = 0x0
_HEADERS = 0x1
_PRIORITY = 0x2
_SETTINGS = 0x4
_PUSH_PROMISE = 0x5
_PING = 0x6
_CONTINUATION = 0x9
_ACK = 0x1
_END_STREAM = 0x1
_END_HEADERS = 0x4
#: HTTP/2 error codes used here (RFC 9113 7).
FLOW_CONTROL_ERROR = 0x3
FRAME_SIZE_ERROR = 0x6
ENHANCE_YOUR_CALM = 0xB
#: What a header block may carry beyond its coded fields: padding (up to
#: 256 bytes), the priority fields, table size updates.
HEADER_BLOCK_SLACK = 512


def max_header_block_size(max_header_list_size: int) -> int:
    """The largest header block that can decode to a header list within
    ``max_header_list_size``: HPACK's longest Huffman code is 30 bits per
    byte, and every other field costs less than the 32 bytes per field the
    list size counts."""
    return max_header_list_size * 30 // 8 + HEADER_BLOCK_SLACK


@dataclass(frozen=True)
class ConnectionBudgets:
    """What one HTTP/2 connection may cost us, whoever the peer is.

    Each budget ends the connection with GOAWAY(ENHANCE_YOUR_CALM) (or the
    error code named) when a peer goes over it; a peer that follows the
    protocol and the settings we advertise never does.
    """

    #: Largest non-DATA frame accepted (HEADERS, CONTINUATION, GOAWAY,
    #: unknown types...); the advertised SETTINGS_MAX_FRAME_SIZE is for DATA.
    max_control_frame_size: int = 64 * KiB
    #: Largest SETTINGS frame: 42 settings of 6 bytes, far more than exist.
    max_settings_frame_size: int = 256
    #: SETTINGS frames (not acks) a peer may send at once, then at
    #: ``settings_rate`` per second: each one costs an ACK we must write.
    settings_burst: int = 100
    settings_rate: float = 10.0
    #: Replies we owe (SETTINGS and PING acks) while our output is stalled
    #: (the peer does not read): more, and the peer is flooding.
    max_stalled_control_replies: int = 100
    #: Streams the client resets before we answered them, at once and then
    #: per second (rapid reset, CVE-2023-44487): each costs us a call set-up.
    reset_burst: int = 200
    reset_rate: float = 100.0
    #: Frames that ask nothing of us and carry nothing (PRIORITY, unknown
    #: types, empty DATA without END_STREAM, acks of nothing we sent), at
    #: once and then per second: gRPC peers hardly send any, a flood of them
    #: is CPU for nothing (Tomcat's "overhead protection" has the same idea).
    idle_frame_burst: int = 1000
    idle_frame_rate: float = 100.0
    #: Frames handed to h2 per receive call; the rest waits for the next one
    #: (:attr:`GrpcConnection.has_pending_input`), so that one connection's
    #: megabyte of tiny frames does not hold up the others.
    max_frames_per_receive: int = 64

    def __post_init__(self) -> None:
        if self.max_control_frame_size < 16 * KiB:
            raise ValueError("max_control_frame_size must be >= 16384 (RFC 9113 4.2)")
        if self.max_settings_frame_size < 36:
            raise ValueError("max_settings_frame_size must be >= 36 (six settings)")
        for name in ("settings_burst", "reset_burst", "idle_frame_burst",
                     "max_stalled_control_replies", "max_frames_per_receive"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.settings_rate <= 0 or self.reset_rate <= 0 or self.idle_frame_rate <= 0:
            raise ValueError("rates must be > 0")


#: Until a peer has authenticated (``GrpcConfig.require_authentication``):
#: a tenth of the bursts and rates, and a fifth of the stalled replies.
UNAUTHENTICATED_BUDGETS = ConnectionBudgets(
    settings_burst=10, settings_rate=1.0, max_stalled_control_replies=20,
    reset_burst=20, reset_rate=10.0, idle_frame_burst=100, idle_frame_rate=10.0)


@dataclass(frozen=True)
class BudgetExceeded:
    """A peer went over a budget: end the connection with ``error_code``."""

    error_code: int
    #: Also the GOAWAY's debug data.
    reason: str


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second of the caller's clock."""

    __slots__ = ("rate", "burst", "_tokens", "_last")

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None

    def take(self, now: float) -> bool:
        """Spend one token; False if there is none left."""
        last = self._last
        if last is not None and now > last:
            self._tokens = min(float(self.burst), self._tokens + (now - last) * self.rate)
        if last is None or now > last:
            self._last = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class FrameScanner:
    """Follows the frame headers of a received HTTP/2 byte stream.

    :meth:`scan` is given every received byte, in order, and checks each
    frame header as soon as its 9 bytes are in: frame sizes, the bytes of a
    header block (HEADERS + CONTINUATION) against the header list limit,
    the SETTINGS rate, frames that do nothing, and the replies owed while
    our output is stalled.
    Payloads are skipped, never copied.
    """

    __slots__ = (
        "budgets", "max_data_frame_size", "max_header_block_size", "output_stalled",
        "stalled_replies", "_skip", "_head", "_block", "_in_block", "_settings", "_idle",
    )

    def __init__(self, budgets: ConnectionBudgets, *, preface_size: int,
                 max_data_frame_size: int, max_header_list_size: int) -> None:
        self.budgets = budgets
        #: No DATA frame may be larger than the largest stream window we give.
        self.max_data_frame_size = max_data_frame_size
        self.max_header_block_size = max_header_block_size(max_header_list_size)
        #: Set by the owner while the transport does not take our output.
        self.output_stalled = False
        self.stalled_replies = 0
        # Bytes to pass before the next frame header (preface or payload),
        # the start of a header split across reads, and the open header block.
        self._skip = preface_size
        self._head = b""
        self._block = 0
        self._in_block = False
        self._settings = TokenBucket(budgets.settings_rate, budgets.settings_burst)
        self._idle = TokenBucket(budgets.idle_frame_rate, budgets.idle_frame_burst)

    def use(self, budgets: ConnectionBudgets) -> None:
        """Apply other budgets from now on (a peer just authenticated)."""
        self.budgets = budgets
        self._settings = TokenBucket(budgets.settings_rate, budgets.settings_burst)
        self._idle = TokenBucket(budgets.idle_frame_rate, budgets.idle_frame_burst)

    def scan(self, data: bytes | memoryview, now: float) -> tuple[int, BudgetExceeded | None]:
        """How many bytes of ``data`` may go to h2 now, and why not more.

        Without a violation the bytes end after at most
        ``max_frames_per_receive`` frame headers (the rest is for the next
        call); with one they end before the offending frame's header.
        """
        pos = 0
        end = len(data)
        frames = 0
        max_frames = self.budgets.max_frames_per_receive
        while pos < end:
            skip = self._skip
            if skip:
                take = skip if skip < end - pos else end - pos
                pos += take
                self._skip = skip - take
                continue
            head = self._head
            if not head and frames >= max_frames:
                break
            need = 9 - len(head)
            if end - pos < need:
                self._head = head + bytes(data[pos:end])
                return end, None
            header = head + bytes(data[pos:pos + need]) if head else bytes(data[pos:pos + 9])
            start = pos - len(head)
            self._head = b""
            pos += need
            frames += 1
            violation = self._check(header, now)
            if violation is not None:
                return max(start, 0), violation
            self._skip = (header[0] << 16) | (header[1] << 8) | header[2]
        return pos, None

    def _check(self, header: bytes, now: float) -> BudgetExceeded | None:
        length = (header[0] << 16) | (header[1] << 8) | header[2]
        kind = header[3]
        flags = header[4]
        budgets = self.budgets
        if kind == _DATA:
            if length > self.max_data_frame_size:
                return BudgetExceeded(FLOW_CONTROL_ERROR,
                                      f"DATA frame of {length} bytes is larger than any window")
            if not length and not flags & _END_STREAM:
                return self.idle_frame(now)
            return None
        if length > budgets.max_control_frame_size:
            return BudgetExceeded(FRAME_SIZE_ERROR,
                                  f"frame of type {kind} and {length} bytes is too large")
        if kind == _HEADERS or kind == _PUSH_PROMISE or kind == _CONTINUATION:
            self._block = self._block + length if kind == _CONTINUATION and self._in_block \
                else length
            self._in_block = not flags & _END_HEADERS
            if self._block > self.max_header_block_size:
                return BudgetExceeded(ENHANCE_YOUR_CALM,
                                      f"header block over {self.max_header_block_size} bytes")
        elif kind == _SETTINGS and not flags & _ACK:
            if length > budgets.max_settings_frame_size:
                return BudgetExceeded(FRAME_SIZE_ERROR, f"SETTINGS frame of {length} bytes")
            if not self._settings.take(now):
                return BudgetExceeded(ENHANCE_YOUR_CALM, "too many SETTINGS frames")
            return self._reply_owed()
        elif kind == _PING and not flags & _ACK:
            return self._reply_owed()
        elif (kind == _SETTINGS or kind == _PING or kind == _PRIORITY
              or kind > _CONTINUATION):
            # Acks (we send few SETTINGS and PINGs), priorities (gRPC has
            # none) and frame types we ignore.
            return self.idle_frame(now)
        return None

    def idle_frame(self, now: float) -> BudgetExceeded | None:
        """Count a frame that does nothing (also called by the owner for
        what only the payload shows, e.g. a tiny WINDOW_UPDATE)."""
        if self._idle.take(now):
            return None
        return BudgetExceeded(ENHANCE_YOUR_CALM, "too many frames that do nothing")

    def _reply_owed(self) -> BudgetExceeded | None:
        if not self.output_stalled:
            return None
        self.stalled_replies += 1
        if self.stalled_replies > self.budgets.max_stalled_control_replies:
            return BudgetExceeded(ENHANCE_YOUR_CALM, "control frames sent while not reading")
        return None
