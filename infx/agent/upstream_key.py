"""The engine agent's credentials for its runtime (``--upstream-api-key-file``, ``$INFX_UPSTREAM_API_KEY``).

A runtime started with an API key (vLLM ``--api-key``, llama-cpp-python
``--api_key``, a hosted OpenAI-compatible service) wants ``Authorization:
Bearer KEY`` on every request, health checks included. The key comes from a
file, read again at most every :data:`CHECK_INTERVAL` seconds (and at once
after the runtime refused it), so that a rotated Kubernetes Secret is used
without a restart: the kubelet swaps the mount's ``..data`` symlink, and the
file's content is what is compared, never its mtime. A key given in the
environment is fixed for the process's life. The key is never logged: a
change is logged by the file's path alone.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

__all__ = ["CHECK_INTERVAL", "UpstreamKey", "UpstreamKeyError", "read_key_file"]

log = Logger(namespace="infx.upstream_key")

#: Seconds between rereads of the key file, on the clock passed in.
CHECK_INTERVAL = 10.0


class UpstreamKeyError(Exception):
    """The key file cannot be used (unreadable, empty, or not one line of printable ASCII)."""


def read_key_file(path: str) -> str:
    """The key in ``path``: its content without surrounding whitespace; raises :class:`UpstreamKeyError`."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise UpstreamKeyError(f"cannot read {path}: {e.strerror}") from None
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise UpstreamKeyError(f"{path} holds non-ASCII bytes; an HTTP header cannot carry them") from None
    if not key:
        raise UpstreamKeyError(f"{path} is empty")
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise UpstreamKeyError(f"{path} holds whitespace or control characters inside the key")
    return key


class UpstreamKey:
    """The current key: fixed (``key``), or read from ``path`` and reread as it changes.

    ``current()`` is called per request; it touches the file at most every
    ``interval`` seconds. A file that becomes unreadable or empty keeps the
    last good key in use (logged), since a Secret update is not atomic for
    every editor and a missing key would fail every request.
    """

    def __init__(self, clock: IReactorTime, *, key: str | None = None, path: str | None = None,
                 interval: float = CHECK_INTERVAL) -> None:
        if (key is None) == (path is None):
            raise ValueError("give exactly one of key and path")
        self._clock = clock
        self._path = path
        self._interval = interval
        self._key = key if key is not None else read_key_file(path)  # type: ignore[arg-type]
        self._checked_at = clock.seconds()
        self._problem: str | None = None

    def current(self) -> str:
        """The key to send now."""
        if self._path is not None and self._clock.seconds() - self._checked_at >= self._interval:
            self._reread()
        return self._key

    def refused(self) -> None:
        """The runtime answered 401: the file may hold a newer key, so the next request rereads it."""
        if self._path is not None:
            self._checked_at = -float("inf")

    def _reread(self) -> None:
        assert self._path is not None
        self._checked_at = self._clock.seconds()
        try:
            key = read_key_file(self._path)
        except UpstreamKeyError as e:
            if str(e) != self._problem:
                log.warn("upstream API key file: {problem}; keeping the key read before", problem=str(e))
                self._problem = str(e)
            return
        self._problem = None
        if key != self._key:
            self._key = key
            log.info("upstream API key file {path} changed: using the new key", path=self._path)
