"""The real dialled peer with its outgoing messages collected, for tests that read them in batches.

The dialled peer returns each message to write as a ``SendToPeer`` output among
the processor effects; :class:`BufferedReceiver` keeps those messages in
order until :meth:`~BufferedReceiver.pop_messages` and returns the effects,
so a test can step a stream by hand the way a link carries it.
"""

from __future__ import annotations

from typing import Any, Union

from protocol.exchange.dialled_peer import DialledPeer, DialledPeerOutput, SendToPeer
from protocol.pb import internal_pb2
from protocol.processor.effects import DeliverResult, Effect, FailRequest


class BufferedReceiver(DialledPeer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbox: list[internal_pb2.ProcessTasksInternalRequest] = []

    def _keep(self, outputs: list[DialledPeerOutput]) -> list[Effect]:
        effects: list[Effect] = []
        for output in outputs:
            if isinstance(output, SendToPeer):
                self.outbox.append(output.message)
            else:
                effects.append(output)
        return effects

    def pop_messages(self) -> list[internal_pb2.ProcessTasksInternalRequest]:
        messages, self.outbox = self.outbox, []
        return messages

    def connected(self, now: float) -> list[Any]:
        return self._keep(super().connected(now))

    def local_engines_changed(self, now: float) -> list[Any]:
        return self._keep(super().local_engines_changed(now))

    def task_received(self, response: internal_pb2.ProcessTasksInternalResponse, now: float) -> list[Any]:
        return self._keep(super().task_received(response, now))

    def deliver(self, effect: Union[DeliverResult, FailRequest]) -> list[Any]:
        return self._keep(super().deliver(effect))

    def shutdown(self, now: float) -> list[Any]:
        return self._keep(super().shutdown(now))

    def closed(self, now: float) -> list[Any]:
        return self._keep(super().closed(now))

    def handle_timeout(self, now: float) -> list[Any]:
        return self._keep(super().handle_timeout(now))
