"""twisted.web's ``Headers`` for the lean server's requests, with the common case made short.

Rules this file keeps: the same answers as ``Headers`` for every input (a test
pins it with Hypothesis); only the path to them is shorter. It reads Twisted's
own name cache (``_nameEncoder``, a private of ``twisted.web.http_headers``): if
a Twisted release renames it, the import fails at start, not a request.
"""

from __future__ import annotations

from typing import Any

from twisted.web.http_headers import Headers, _nameEncoder

__all__ = ["LeanHeaders"]

_CANONICAL = _nameEncoder._canonicalHeaderCache


class LeanHeaders(Headers):
    """twisted.web's ``Headers``, the same names (canonical case), values (line breaks made
    spaces) and answers, with the common case made short: a name seen before is looked up in
    Twisted's own cache without a call, and a value is split on line breaks only if it holds one.
    A request by URL reads or writes about twenty headers; these calls were 4 % of its CPU."""

    __slots__ = ()

    def hasHeader(self, name: Any) -> bool:
        return (_CANONICAL.get(name) or _nameEncoder.encode(name)) in self._rawHeaders

    def setRawHeaders(self, name: str | bytes, values: Any) -> None:
        encoded = []
        for value in values:
            if type(value) is str:
                value = value.encode("utf8")  # as Headers encodes a str value
            if type(value) is not bytes or b"\r" in value or b"\n" in value:
                super().setRawHeaders(name, values)
                return
            encoded.append(value)
        self._rawHeaders[_CANONICAL.get(name) or _nameEncoder.encode(name)] = encoded

    def addRawHeader(self, name: str | bytes, value: str | bytes) -> None:
        if type(value) is bytes and b"\r" not in value and b"\n" not in value:
            self._rawHeaders.setdefault(_CANONICAL.get(name) or _nameEncoder.encode(name), []).append(value)
        else:
            super().addRawHeader(name, value)

    def getRawHeaders(self, name: Any, default: Any = None) -> Any:
        if type(name) is not bytes:
            return super().getRawHeaders(name, default)
        return self._rawHeaders.get(_CANONICAL.get(name) or _nameEncoder.encode(name)) or default
