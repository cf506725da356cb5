"""The processor's errors: the caller's misuse, and a peer gateway breaking the exchange's protocol.

Both derive from one of :mod:`protocol.errors`' two kinds (local misuse, remote violation).
"""

from __future__ import annotations

from protocol import errors

__all__ = ["PeerProtocolError", "ProcessorError", "ProcessorUsageError"]


class ProcessorError(Exception):
    """Base of the processor's exceptions."""


class ProcessorUsageError(ProcessorError, errors.LocalUsageError):
    """The caller misused the processor (duplicate task id, unknown task, bad config).

    Remote misbehaviour (an engine sending results out of order, an engine
    vanishing) never raises: it ends the affected task with a
    :class:`FailRequest` whose status says what went wrong on the wire.
    """


class PeerProtocolError(ProcessorError, errors.RemoteProtocolError):
    """A peer gateway sent a message that breaks the protocol; its stream should end.

    ``grpc_status`` is the status to end the stream with (3, INVALID_ARGUMENT).
    """

    grpc_status = 3
