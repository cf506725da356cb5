"""``python -m infx.plugin_cache``: write Twisted's plugin caches once, as the user who installed infx.

Twisted keeps a ``dropin.cache`` beside the plugin stubs in every
``twisted/plugins/`` directory on ``sys.path`` and rewrites it whenever a
stub is newer than the cache. Installing infx adds a stub, so the first
``twistd`` run rewrites the cache; a non-root user cannot, and Twisted logs
``Unable to write to plugin cache ... error number 13`` at every start.
Running this once after ``pip install`` (the Dockerfile does, as root) writes
the caches so that no later start needs to. It exits non-zero, naming the
directory, when a cache still cannot be written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from twisted.plugin import IPlugin, getPlugins


def stale_caches() -> list[Path]:
    """The plugin directories whose ``dropin.cache`` is missing or older than a stub in them."""
    import twisted.plugins

    stale = []
    for directory in map(Path, twisted.plugins.__path__):
        stubs = [p for p in directory.glob("*.py") if p.name != "__init__.py"]
        if not stubs:
            continue
        cache = directory / "dropin.cache"
        cached = cache.stat().st_mtime if cache.exists() else 0.0
        if any(stub.stat().st_mtime >= cached for stub in stubs):
            stale.append(cache)
    return stale


def refresh() -> list[Path]:
    """Scan every plugin (which writes the caches it can); the caches still stale afterwards."""
    list(getPlugins(IPlugin))
    return stale_caches()


def main() -> int:
    left = refresh()
    for cache in left:
        print(f"infx.plugin_cache: cannot write {cache} "
              f"({'not writable by' if not os.access(cache.parent, os.W_OK) else 'failed for'} uid {os.getuid()}); "
              "run this as the user who installed infx", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
