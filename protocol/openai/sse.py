"""Server-sent events: an incremental parser, a block splitter and an encoder; pure, no I/O.

Rules this file keeps: bytes in (split anywhere), events out, exactly as the
HTML standard's event-stream interpretation says: CRLF, LF and CR line
ends; ``data`` lines joined with LF; ``event``, ``id`` and ``retry`` fields;
comments and unknown fields ignored; a leading BOM dropped; an unfinished
event at the end of the stream never dispatched. Events may be of any size
up to a configurable bound, past which the parser raises
:class:`EventTooLarge` (a runtime's violation, HTTP 502) instead of
buffering without end.

On LLMariner's wire an engine forwards the runtime's stream verbatim:
each ``ServerSentEvent.data`` is one framed block (``data: {...}\\n\\n``) and
the gateway concatenates them into its response body, so this parser reads
that body as it would the runtime's own; an engine cuts the runtime's stream
into those blocks with :class:`SSEBlockSplitter`, byte for byte. Error events
(``data: {"error": ...}``) come from :mod:`protocol.openai.errors`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from protocol.openai.errors import OpenAIUsageError, UpstreamError

DEFAULT_MAX_EVENT_SIZE = 16 * 1024 * 1024
#: What the data of the last event of a chat or completions stream says; the one definition.
DONE_DATA = "[DONE]"
DONE_EVENT = b"data: " + DONE_DATA.encode("ascii") + b"\n\n"
#: How the last line of a piece of a stream that ends with DONE_EVENT may start, after a blank line.
_DONE_ENDS = tuple(end + DONE_EVENT.rstrip() for end in (b"\n\n", b"\r\n\r\n", b"\r\r"))

_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
_LF = 0x0A
_LINE_END = re.compile(rb"[\r\n]")
_TEXT_LINE_END = re.compile(r"\r\n|\r|\n")
_BYTES_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True)
class EventReceived:
    """A complete event: its data (lines joined with LF), type, and the stream's last event id."""

    data: str
    event: str = "message"
    last_event_id: str = ""


@dataclass(frozen=True)
class RetryReceived:
    """The stream asked for a new reconnection delay."""

    milliseconds: int


Event = EventReceived | RetryReceived


class EventTooLarge(UpstreamError):
    """An event grew past the parser's ``max_event_size`` before it ended."""


class SSEParser:
    """Incremental event-stream parser: ``receive_data(bytes) -> [events]``.

    ``max_event_size`` bounds the bytes of one event (all its lines,
    including an unfinished one); ``None`` lifts the bound. After
    :class:`EventTooLarge` the stream is unusable and the parser refuses
    more data.
    """

    def __init__(self, max_event_size: int | None = DEFAULT_MAX_EVENT_SIZE) -> None:
        self.max_event_size = max_event_size
        self._buffer = bytearray()
        self._scan_from = 0
        self._skip_lf = False
        self._at_start = True
        self._failed = False
        self._data: list[str] = []
        self._has_data = False
        self._event_type = ""
        self._last_event_id = ""
        self._event_size = 0

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed the next bytes of the stream; returns the events they complete."""
        if self._failed:
            raise OpenAIUsageError("the event stream already failed; start a new parser")
        buf = self._buffer
        buf += data
        pos = 0
        if self._skip_lf and buf:
            self._skip_lf = False
            if buf[0] == _LF:
                pos = 1
        if self._at_start:
            if len(buf) < len(_BOM) and _BOM.startswith(bytes(buf)):
                return []
            self._at_start = False
            if buf.startswith(_BOM):
                pos = len(_BOM)
        events: list[Event] = []
        scan = max(pos, self._scan_from)
        while (match := _LINE_END.search(buf, scan)) is not None:
            end = match.start()
            after = end + 1
            if buf[end] == _CR:
                if after == len(buf):
                    self._skip_lf = True
                elif buf[after] == _LF:
                    after += 1
            self._event_size += after - pos
            self._check_size(0)
            self._line(bytes(buf[pos:end]), events)
            pos = scan = after
        del buf[:pos]
        self._scan_from = len(buf)
        self._check_size(len(buf))
        return events

    @property
    def between_events(self) -> bool:
        """Nothing of an unfinished event is held (nor a BOM still possible): the next bytes start a new one."""
        return not self._buffer and not self._event_size and not self._skip_lf and not self._at_start

    def _check_size(self, pending: int) -> None:
        if self.max_event_size is not None and self._event_size + pending > self.max_event_size:
            self._failed = True
            raise EventTooLarge(f"A server-sent event exceeded {self.max_event_size} bytes.")

    def _line(self, raw: bytes, events: list[Event]) -> None:
        if not raw:
            self._dispatch(events)
            return
        line = raw.decode("utf-8", "replace")
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\0" not in value:
                self._last_event_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                events.append(RetryReceived(int(value)))

    def _dispatch(self, events: list[Event]) -> None:
        if self._has_data:
            events.append(EventReceived("\n".join(self._data), self._event_type or "message", self._last_event_id))
        self._data = []
        self._has_data = False
        self._event_type = ""
        self._event_size = 0


class SSEBlockSplitter:
    """Cuts an event stream into its raw events, each with the blank line that ends it.

    Unlike :class:`SSEParser` it keeps the runtime's framing
    byte for byte (``event:``/``id:`` lines, comments, line ends), which is
    what ``ServerSentEvent.data`` carries on LLMariner's wire. Empty blocks
    (repeated blank lines) are skipped; an event longer than
    ``max_event_size`` raises :class:`EventTooLarge`. Pure.
    """

    def __init__(self, max_event_size: int | None = DEFAULT_MAX_EVENT_SIZE) -> None:
        self.max_event_size = max_event_size
        self._buffer = bytearray()
        self._scan = 0
        self._line_start = 0

    def receive_data(self, data: bytes) -> list[bytes]:
        """Feed bytes (split anywhere); returns the events they complete."""
        buf = self._buffer
        buf += data
        events: list[bytes] = []
        block_start = 0
        while (match := _LINE_END.search(buf, self._scan)) is not None:
            end = match.start()
            if buf[end] == _CR:
                if end + 1 == len(buf):
                    break  # a CR LF may be split across reads
                after = end + 2 if buf[end + 1] == _LF else end + 1
            else:
                after = end + 1
            if end == self._line_start:
                block = bytes(buf[block_start:after])
                if end > block_start:
                    events.append(block)
                block_start = after
            self._line_start = self._scan = after
        del buf[:block_start]
        self._scan -= block_start
        self._line_start -= block_start
        if self.max_event_size is not None and len(buf) > self.max_event_size:
            raise EventTooLarge(f"A server-sent event exceeded {self.max_event_size} bytes.")
        return events

    def end_of_stream(self) -> bytes | None:
        """An unterminated last event, closed with a blank line (None if there is none)."""
        rest = bytes(self._buffer).rstrip(b"\r\n")
        self._buffer.clear()
        self._scan = self._line_start = 0
        return rest + b"\n\n" if rest else None




def ends_with_done(data: bytes) -> bool:
    """Whether the whole events ``data`` holds (one, or several relayed together) end with ``[DONE]``."""
    stripped = data.rstrip(b"\r\n")
    return stripped == DONE_EVENT.rstrip() or stripped.endswith(_DONE_ENDS)


def encode_event(data: str | bytes, *, event: str | None = None, event_id: str | None = None) -> bytes:
    """One framed event; data holding line breaks becomes several ``data:`` lines.

    Bytes are framed as they are (the relay path for a runtime's JSON,
    which needs no decoding).
    """
    head = b""
    for name, value in (("event", event), ("id", event_id)):
        if value is not None:
            if _TEXT_LINE_END.search(value) or (name == "id" and "\0" in value):
                raise OpenAIUsageError(f"an SSE {name} must be one line")
            head += f"{name}: {value}\n".encode("utf-8")
    raw = data if isinstance(data, bytes) else data.encode("utf-8")
    lines = b"".join(b"data: " + line + b"\n" for line in _BYTES_LINE_END.split(raw))
    return head + lines + b"\n"


def encode_json(value: Any) -> bytes:
    """One event whose data is ``value`` as compact JSON (one line, so one ``data:`` field)."""
    return encode_event(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
