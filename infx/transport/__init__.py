"""gRPC on Twisted: a thin adapter that feeds :mod:`protocol.grpc` and
performs its effects, usable on its own.

The package keeps one concern per module: ``writes`` (the write path: one
gathering write per batch), ``connection`` (the HTTP/2 connection adapter:
reads, the timer, backpressure), ``calls`` (status, errors, what server and
client calls share), ``server`` (methods, handlers, ``GrpcServer``) and
``client`` (``GrpcChannel`` performing :class:`protocol.grpc.channel.ChannelMachine`'s
effects, ``ClientCall``).  Everything public is importable from here.

Backpressure: a call's ``send()`` returns an already-fired Deferred while
little is queued for it and the transport is not paused (the protocol is
the transport's push producer); otherwise the Deferred fires when the
machine reports the queue drained (peer's flow-control window) and the
transport has resumed.  Received messages are acknowledged to HTTP/2 flow
control when ``recv()`` hands them over, so a slow reader slows its sender.

Server::

    server = GrpcServer(reactor)
    server.add_method("/pkg.Svc/Echo", echo, Request.FromString,
                      Response.SerializeToString, kind=CallKind.UNARY_UNARY)
    port = await listen_grpc(reactor, "tcp:50051", server)

Client::

    channel = GrpcChannel(reactor, client_endpoint(reactor, "h", 50051))
    reply = await channel.unary("/pkg.Svc/Echo", req, Request.SerializeToString,
                                Response.FromString, timeout=5)
    call = channel.stream("/pkg.Svc/Chat", ser, deser)
    await call.send(msg); call.end()
    async for reply in call: ...
"""

from infx.transport.calls import CallKind, Deserializer, GrpcError, Serializer, Status
from infx.transport.client import ChannelState, ClientCall, GrpcChannel, client_endpoint
from infx.transport.connection import GrpcProtocol
from infx.transport.server import GrpcServer, ServerCall, listen_grpc
from protocol.grpc import StatusCode

__all__ = [
    "CallKind", "ChannelState", "ClientCall", "Deserializer", "GrpcChannel", "GrpcError",
    "GrpcProtocol", "GrpcServer", "Serializer", "ServerCall", "Status", "StatusCode",
    "client_endpoint", "listen_grpc",
]
