"""The two kinds of error every machine in ``protocol/`` raises; pure, no I/O.

Rules this file keeps: every error class in ``protocol/`` derives from
exactly one of these two, so a caller can tell a bug on its own side from a
peer that broke the protocol without knowing each machine's classes (as
h11 does with ``LocalProtocolError`` and ``RemoteProtocolError``):

- :class:`LocalUsageError`: the caller drove a machine wrongly (an unknown
  stream, an input out of turn, a bad configuration). A bug in infx; it is
  never shown to a peer or a client as its fault.
- :class:`RemoteProtocolError`: the other side (gateway, engine, peer,
  runtime, client, Kubernetes API) sent something the protocol does not
  allow. The subclass carries the wire meaning the answer needs: an HTTP
  status and OpenAI error body, a gRPC status, or which stream or task to drop.

Each subclass keeps its own name and meaning; these bases add none.
"""

from __future__ import annotations

__all__ = ["LocalUsageError", "RemoteProtocolError"]


class LocalUsageError(Exception):
    """The caller used a machine wrongly: a bug on this side, never the peer's fault."""


class RemoteProtocolError(Exception):
    """The remote side broke the protocol; the subclass says what that means on the wire."""
