"""The engine-facing gRPC service: ``InferenceWorkerService.ProcessTasks``.

Each engine holds one bidirectional stream: it reports ``EngineStatus`` and
sends ``TaskResult``s up, and receives ``Task``s down. The stream is the
engine's route in the processor; when it ends, for whatever reason, the
processor removes its engines and fails their tasks over.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.logger import Logger

from infx.auth import KeyStore
from infx.dispatcher import MAX_ROUTE_QUEUED_BYTES, Dispatcher, SendOutcome, StreamSendGate
from infx.transport import CallKind, GrpcError, GrpcServer, ServerCall
from protocol.grpc import StatusCode
from protocol.pb import worker_pb2
from protocol.processor_types import Locality

log = Logger()

PROCESS_TASKS = "/llmariner.inference.server.v1.InferenceWorkerService/ProcessTasks"


def metadata_value(call: ServerCall, name: str) -> str | None:
    for key, value in call.metadata:
        if key == name:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


class EngineStream:
    """One engine's ProcessTasks stream, as the processor's route to it.

    Sends go through the call one at a time in order (the transport queues
    them), so the stream has a single writer by construction. An engine that
    stops reading blocks the route (see :class:`~infx.dispatcher.StreamSendGate`);
    ``on_drained`` is called when it drains again.
    """

    def __init__(self, call: ServerCall, peer: str, on_drained: Callable[[EngineStream], None] | None = None,
                 max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.call = call
        self.peer = peer
        self.closed = False
        self._on_drained = on_drained
        self._gate = StreamSendGate(call, self._drained, max_queued_bytes)

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        return self._gate.send(worker_pb2.ProcessTasksResponse(new_task=task))

    def _drained(self) -> None:
        if not self.closed and self._on_drained is not None:
            self._on_drained(self)

    def close(self, reason: str) -> None:
        """End the stream: with a status, or with a reset if messages the engine has not
        read are queued (a status behind them would never go out)."""
        if not self.closed:
            self.closed = True
            if self.call.buffered_amount:
                self.call.reset(reason)
            else:
                self.call.abort(StatusCode.UNAVAILABLE, reason)

    def __repr__(self) -> str:
        return f"<EngineStream {self.peer}>"


class WorkerService:
    """Serves ProcessTasks for engines, authenticated by bearer key when keys are configured."""

    def __init__(self, dispatcher: Dispatcher, keys: KeyStore, max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.dispatcher = dispatcher
        self.keys = keys
        self.max_queued_bytes = max_queued_bytes
        self.streams: set[EngineStream] = set()
        #: False once the gateway shuts down: engines told to go away must not come back here.
        self.accepting = True

    def register(self, server: GrpcServer) -> None:
        server.add_method(
            PROCESS_TASKS, self.process_tasks, worker_pb2.ProcessTasksRequest.FromString,
            worker_pb2.ProcessTasksResponse.SerializeToString, kind=CallKind.STREAM_STREAM,
        )

    async def process_tasks(self, call: ServerCall) -> None:
        if not self.accepting:
            raise GrpcError(StatusCode.UNAVAILABLE, "gateway is shutting down")
        principal = self.keys.engine(metadata_value(call, "authorization"))
        if principal is None:
            raise GrpcError(StatusCode.UNAUTHENTICATED, "missing or unknown engine key")
        stream = EngineStream(call, str(call.peer), self.dispatcher.route_writable, self.max_queued_bytes)
        self.streams.add(stream)
        reason = "engine stream ended"
        try:
            while True:
                message: Any = await call.recv()
                if message is None:
                    break
                kind = message.WhichOneof("message")
                if kind == "engine_status":
                    if not message.engine_status.engine_id:
                        raise GrpcError(StatusCode.INVALID_ARGUMENT, "engine status without engine_id")
                    self.dispatcher.engine_status(stream, principal.tenant, message.engine_status, Locality.LOCAL)
                elif kind == "task_result":
                    self.dispatcher.result_received(stream, message.task_result)
        except GrpcError as e:
            reason = f"engine stream ended: {e.code.name} {e.message}"
            raise
        finally:
            stream.closed = True
            self.streams.discard(stream)
            self.dispatcher.route_closed(stream, reason)
