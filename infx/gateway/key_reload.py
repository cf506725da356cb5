"""Reads the API key file again when it changes, so that a revoked key stops working within seconds.

Twisted side; the parsing is :func:`infx.gateway.auth.parse_key_file`. Every
:data:`CHECK_INTERVAL` seconds on the clock passed in, the file is
``stat``-ed, following symlinks: an in-place rewrite changes its size or
mtime, and a Kubernetes Secret update (which swaps the ``..data`` symlink
to a new directory) changes the inode. Only a changed file is read. A
version that parses replaces the keys at once; one that does not (a typo,
an unknown member, the file missing) keeps the current keys and is logged
once, not at every check, until the file changes again.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from infx.gateway.auth import KeyFileError, KeyStore, read_key_file

log = Logger(namespace="infx.key_reload")

#: Seconds between checks of the key file (the TLS files are checked every 30 s; a revoked key is more urgent).
CHECK_INTERVAL = 2.0

#: What ``stat`` says of one version of the file; None when it cannot be stat-ed.
Signature = tuple[int, int, int, int, int] | None


_NONE = object()


def file_signature(path: str) -> Signature:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyFileReload(Service):
    """Keeps ``store`` (loaded from ``store.source``) in step with the file."""

    def __init__(self, clock: IReactorTime, store: KeyStore, signature: Signature,
                 interval: float = CHECK_INTERVAL) -> None:
        """``signature``: the file's, taken before the read that filled ``store``."""
        if not store.enabled or store.source is None:
            raise ValueError("the key store was not loaded from a file")
        self.store = store
        self.path = store.source
        self.interval = interval
        self._clock = clock
        self._loaded = signature
        self._rejected: object = _NONE  # the version last refused, logged once
        self._loop: LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.check)
        self._loop.clock = self._clock
        self._loop.start(self.interval, now=False)

    def stopService(self) -> Any:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def check(self) -> None:
        """Reload the keys if the file changed since they were loaded."""
        signature = file_signature(self.path)
        if signature == self._loaded or signature == self._rejected:
            return
        try:
            if signature is None:
                raise KeyFileError(f"cannot read API key file {self.path}: it is missing")
            tables = read_key_file(self.path)
        except KeyFileError as e:
            self._rejected = signature
            log.warn("API keys: keeping the current keys, the changed file does not load: {error}", error=str(e))
            return
        self.store.replace(tables)
        self._loaded = signature
        self._rejected = _NONE
        log.info("API keys: loaded {clients} client and {engines} engine key(s) from {path}",
                 clients=len(tables.clients), engines=len(tables.engines), path=self.path)


def watched_key_store(clock: IReactorTime, path: str, interval: float = CHECK_INTERVAL) -> tuple[KeyStore, KeyFileReload]:
    """The keys of ``path`` and the service that reloads them; raises :class:`~infx.gateway.auth.KeyFileError`."""
    signature = file_signature(path)  # before the read: a change during it is seen at the first check
    store = KeyStore.from_file(path)
    return store, KeyFileReload(clock, store, signature, interval)


__all__ = ["CHECK_INTERVAL", "KeyFileReload", "file_signature", "watched_key_store"]
