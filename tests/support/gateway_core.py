"""Gateway cores on a hand-stepped clock, joined by hand-carried peer streams (no I/O), for core and schedule tests."""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from protocol.gateway.core import GatewayCore
from protocol.gateway.effects import (
    CancelDial,
    CoreConfig,
    Dial,
    EndPeerStream,
    HalfCloseDial,
    OpenDial,
    SendOnDial,
)
from protocol.pb import internal_pb2
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig
from protocol.processor.effects import CancelTaskOnEngine, SendTask
from protocol.processor.keys import Locality
from tests.support.processor import chat, engine_status, only


T0 = 100.0


def core(name: str, **config: Any) -> GatewayCore:
    processor_config = config.pop("processor", ProcessorConfig())
    return GatewayCore(Processor(processor_config), CoreConfig(pod_name=name, **config), random.Random(1))


class Client:
    """An HTTP request's handle: what reached it, in order."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id

    def __repr__(self) -> str:
        return f"<Client {self.task_id}>"


class Net:
    """Gateway cores joined by hand-carried ``ProcessTasksInternal`` streams, no I/O.

    The harness plays the adapters: an ``OpenDial`` of one core opens an accepted stream
    on the core it names, its ``SendOnDial`` messages reach that stream, and a ``SendTask``
    on the accepted stream comes back to the dial as a forwarded task. Engine routes are
    ``"engine:<id>"``; what a core asks of its engines and clients is kept per core.
    """

    def __init__(self, *names: str, llmariner: tuple[str, ...] = (), **config: Any) -> None:
        self.now = T0
        #: Cores that accept streams the way a LLMariner gateway does: no status-delta header.
        self.llmariner = llmariner
        self.cores = {name: core(name, **config) for name in names}
        self.effects: dict[str, list[Any]] = {name: [] for name in names}
        self.streams: dict[Dial, tuple[str, object]] = {}  # dial -> (accepting core, its stream)
        self._stream_ids = itertools.count()
        self.dial_of: dict[object, tuple[str, Dial]] = {}  # accepted stream -> (dialling core, dial)
        self._queue: deque[Callable[[], None]] = deque()
        self._carrying = False

    def run(self, name: str, step: Callable[[float], list[Any]]) -> list[Any]:
        out = step(self.now)
        self.effects[name] += out
        for effect in out:
            self._carry(name, effect)
        self.pump()
        return out

    def later(self, name: str, step: Callable[[float], list[Any]]) -> None:
        self._queue.append(lambda: self.run(name, step) and None)

    def pump(self) -> None:
        if self._carrying:
            return
        self._carrying = True
        try:
            while self._queue:
                self._queue.popleft()()
        finally:
            self._carrying = False

    def _carry(self, name: str, effect: Any) -> None:
        if isinstance(effect, OpenDial):
            # Unique, as a transport's stream objects are: a peer forgotten and dialled again
            # starts over at attempt 1, and an equal key would pass for its older stream.
            stream = ("stream", name, effect.dial.attempt, next(self._stream_ids))
            self.streams[effect.dial] = (effect.dial.address, stream)
            self.dial_of[stream] = (name, effect.dial)
            target = str(effect.dial.address)
            # A core's name is its address here, and what its dials' headers offer to be dialled back at.
            self.later(target, lambda now: self.cores[target].accepted_peer_opened(stream, name, now))
            headers = () if target in self.llmariner else self.cores[target].accept_metadata
            self.later(name, lambda now: self.cores[name].dial_accepted(effect.dial, headers, now))
        elif isinstance(effect, SendOnDial):
            target, stream = self.streams[effect.dial]
            self.later(target, lambda now: self.cores[target].accepted_peer_message(stream, effect.message, now))
        elif isinstance(effect, (HalfCloseDial, CancelDial)):
            target, stream = self.streams[effect.dial]
            self.later(target, lambda now: self.cores[target].accepted_peer_closed(stream, now))
            if isinstance(effect, HalfCloseDial):
                self.later(name, lambda now: self.cores[name].dial_closed(effect.dial, now))
        elif isinstance(effect, EndPeerStream) and effect.stream in self.dial_of:
            dialler, dial = self.dial_of[effect.stream]
            self.later(dialler, lambda now: self.cores[dialler].dial_closed(dial, now))
        elif isinstance(effect, (SendTask, CancelTaskOnEngine)) and effect.route in self.dial_of:
            dialler, dial = self.dial_of[effect.route]
            message = internal_pb2.ProcessTasksInternalResponse(new_task=effect.task, tenant_id=effect.engine.tenant_id)
            self.later(dialler, lambda now: self.cores[dialler].dial_message(dial, message, now))

    def engine_joins(self, name: str, engine_id: str, *models: str, ready: bool = True) -> None:
        route = f"engine:{engine_id}"
        self.run(name, lambda now: self.cores[name].engine_status(
            route, "t", engine_status(engine_id, *models, ready=ready), Locality.LOCAL, now))

    def submit(self, name: str, task_id: str, model: str = "m", stream: bool = False) -> Client:
        client = Client(task_id)
        self.run(name, lambda now: self.cores[name].submit(client, task_id, "t", model, chat(model, stream), {}, None,
                                                          now))
        return client

    def sent_to_engine(self, name: str, engine_id: str) -> list[str]:
        return [e.task.id for e in only(self.effects[name], SendTask) if e.route == f"engine:{engine_id}"]

    def of(self, name: str, kind: type) -> list[Any]:
        return only(self.effects[name], kind)
