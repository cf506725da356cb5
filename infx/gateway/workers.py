"""The engine-facing gRPC service: ``InferenceWorkerService.ProcessTasks``.

Each engine holds one bidirectional stream: it reports ``EngineStatus`` and
sends ``TaskResult``s up, and receives ``Task``s down. The stream is the
engine's route in the processor; when it ends, for whatever reason, the
processor removes its engines and fails their tasks over.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.logger import Logger

from infx.gateway.auth import KeyStore
from infx.gateway.dispatcher import Dispatcher, SendOutcome, StreamSendGate
from infx.transport import CallKind, GrpcError, GrpcServer, ServerCall
from protocol.grpc import StatusCode
from protocol.pb import worker_pb2
from protocol.processor.keys import Locality
from protocol.repeats import RepeatSuppressor
from protocol.processor.route_flow import MAX_ROUTE_QUEUED_BYTES

log = Logger(namespace="infx.workers")

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
    stops reading blocks the route (see :class:`~infx.gateway.dispatcher.StreamSendGate`);
    ``on_drained`` is called when it drains again.
    """

    def __init__(self, call: ServerCall, peer: str, authorization: str | None = None,
                 principal: Any = None, on_drained: Callable[[EngineStream], None] | None = None,
                 max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.call = call
        self.peer = peer
        self.closed = False
        #: Why the processor refused this engine, if it did (another engine process's id).
        self.refusal = ""
        #: What the engine presented and who that made it, to end the stream if its key is revoked.
        self.authorization = authorization
        self.principal = principal
        self._on_drained = on_drained
        self._gate = StreamSendGate(call, self._drained, max_queued_bytes)

    def send_task(self, task: worker_pb2.Task, tenant_id: str) -> SendOutcome:
        if self.closed:
            return SendOutcome.GONE
        return self._gate.send(worker_pb2.ProcessTasksResponse(new_task=task), task.id)

    def withdraw_task(self, wire_id: str) -> bool:
        return not self.closed and self._gate.withdraw(wire_id)

    @property
    def queued_bytes(self) -> int:
        """Bytes queued for the engine that it has not taken yet."""
        return self._gate.queued_bytes

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

    def refuse(self, reason: str) -> None:
        """End the stream of an engine the processor refused (it claims another engine's id)."""
        if not self.closed:
            self.closed = True
            self.refusal = reason
            self.call.abort(StatusCode.ALREADY_EXISTS, reason)

    def __repr__(self) -> str:
        return f"<EngineStream {self.peer}>"


class WorkerService:
    """Serves ProcessTasks for engines, authenticated by bearer key when keys are configured."""

    def __init__(self, dispatcher: Dispatcher, keys: KeyStore, max_queued_bytes: int = MAX_ROUTE_QUEUED_BYTES) -> None:
        self.dispatcher = dispatcher
        self.keys = keys
        self.max_queued_bytes = max_queued_bytes
        self.streams: set[EngineStream] = set()
        keys.on_replaced.append(self.keys_replaced)
        #: False once the gateway shuts down: engines told to go away must not come back here.
        self.accepting = True
        #: An engine with a wrong key redials forever: its refusal is logged once per host, then counted.
        self.refusals = RepeatSuppressor()

    def register(self, server: GrpcServer) -> None:
        server.add_method(
            PROCESS_TASKS, self.process_tasks, worker_pb2.ProcessTasksRequest.FromString,
            worker_pb2.ProcessTasksResponse.SerializeToString, kind=CallKind.STREAM_STREAM,
        )

    def keys_replaced(self) -> None:
        """The key file was reloaded: an engine whose key is gone, or now names another tenant,
        loses its stream (its tasks fail over) and must dial again with a valid key."""
        for stream in list(self.streams):
            if not stream.closed and self.keys.engine(stream.authorization) != stream.principal:
                log.warn("engine {peer}: its key was removed or changed in the key file; ending its stream",
                         peer=stream.peer)
                stream.closed = True
                stream.call.abort(StatusCode.UNAUTHENTICATED, "engine key revoked")
                # Now, not when the handler's pending recv() ends: its engines go and tasks fail over.
                self.streams.discard(stream)
                self.dispatcher.route_closed(stream, "engine key revoked")

    async def process_tasks(self, call: ServerCall) -> None:
        if not self.accepting:
            raise GrpcError(StatusCode.UNAVAILABLE, "gateway is shutting down")
        address = str(call.peer)
        authorization = metadata_value(call, "authorization")
        principal = self.keys.engine(authorization)
        if principal is None:
            self._refused(address, "missing or unknown engine key")
            raise GrpcError(StatusCode.UNAUTHENTICATED, "missing or unknown engine key")
        call.authenticated()
        # Headers now, not with the first task: the engine learns at once that it is in (and logs it).
        call.send_initial_metadata()
        stream = EngineStream(call, address, authorization, principal, self.dispatcher.route_writable,
                              self.max_queued_bytes)
        self.streams.add(stream)
        reason = "engine stream ended"
        engine_id = ""
        models: tuple[tuple[str, bool], ...] | None = None

        def on_message(message: Any) -> None:
            nonlocal engine_id, models
            kind = message.WhichOneof("message")
            if kind == "task_result":
                self.dispatcher.result_received(stream, message.task_result)
            elif kind == "engine_status":
                status = message.engine_status
                if not status.engine_id:
                    self._refused(address, "engine status without engine_id")
                    raise GrpcError(StatusCode.INVALID_ARGUMENT, "engine status without engine_id")
                reported = tuple(sorted((m.id, m.is_ready and status.ready) for m in status.models))
                self.dispatcher.engine_status(stream, principal.tenant, status, Locality.LOCAL)
                if stream.refusal:
                    self._refused(address, stream.refusal)  # never registered: no "connected" line
                    return
                if not engine_id:
                    engine_id = status.engine_id
                    log.info("engine {engine_id} connected from {address}: tenant {tenant!r}, models {models}",
                             engine_id=engine_id, address=address, tenant=principal.tenant,
                             models=_models_text(reported), event="engine_connected")
                elif reported != models:
                    log.info("engine {engine_id}: models now {models}", engine_id=engine_id,
                             models=_models_text(reported), event="engine_models_changed")
                models = reported

        try:
            # One call per message as it arrives (a result per relayed event), no Deferred each.
            await call.read_each(on_message)
        except GrpcError as e:
            reason = f"engine stream ended: {e.code.name} {e.message}"
            raise
        finally:
            stream.closed = True
            self.streams.discard(stream)
            if engine_id:
                log.info("engine {engine_id} gone ({address}): {reason}", engine_id=engine_id, address=address,
                         reason=reason, event="engine_gone")
            self.dispatcher.route_closed(stream, reason)

    def _refused(self, address: str, why: str) -> None:
        host = address.rsplit(":", 1)[0] if ":" in address else address
        now = self.dispatcher.clock.seconds()
        for report in self.refusals.occurred(host, f"engine at {host} refused: {why}", now):
            log.warn("{text}", text=report.text(), address=address, event="engine_refused", count=report.count)


def _models_text(models: tuple[tuple[str, bool], ...]) -> str:
    return ", ".join(f"{model} ({'ready' if ready else 'not ready'})" for model, ready in models) or "none"
