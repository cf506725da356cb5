"""The runtime's health check on Twisted: performs :class:`protocol.agent.runtime_health.RuntimeHealth`'s effects.

Every decision (when, which path, what an answer means) is the pure
machine's; this service GETs the path on the ``openai`` runtime's server
(with its credentials), reports the outcome, arms one timer from
``next_deadline()``, and tells the engine agent when readiness changes.
A task that could not reach the runtime triggers a check at once, through
:attr:`infx.agent.runtimes.OpenAIRuntime.on_unreachable`.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from infx.agent.runtimes import OpenAIRuntime
from infx.agent.side_http import CappedBody, quiet_pool
from infx.deadline import DeadlineTimer
from protocol.agent.runtime_health import CheckRuntime, HealthEffect, ReadinessChanged, RuntimeHealth

__all__ = ["MAX_CHECK_BODY", "RuntimeWatch", "check_pool"]

log = Logger(namespace="infx.runtime_watch")

#: A model list larger than this is not read (a check is not worth a large buffer).
MAX_CHECK_BODY = 1024 * 1024


def check_pool(clock: IReactorTime) -> HTTPConnectionPool:
    """Connections for the health checks alone, so that a check never waits behind busy task
    connections; one kept open per runtime, quiet in the log."""
    return quiet_pool(clock, 1)


class RuntimeWatch(Service):
    """Checks the runtime behind ``runtime`` and calls ``changed(ready, models)`` when that changes."""

    def __init__(self, clock: IReactorTime, machine: RuntimeHealth, agent: IAgent, runtime: OpenAIRuntime,
                 changed: Callable[[bool, tuple[str, ...]], None]) -> None:
        self.clock = clock
        self.machine = machine
        self.agent = agent
        self.runtime = runtime
        self.changed = changed
        self._timer = DeadlineTimer(clock, lambda: self._run(self.machine.handle_timeout(self.clock.seconds())))
        self._pending: Deferred[object] | None = None
        runtime.on_unreachable.append(self._unreachable)

    def startService(self) -> None:
        super().startService()
        self._run(self.machine.start(self.clock.seconds()))

    def stopService(self) -> None:
        super().stopService()
        self._timer.cancel()
        if self._pending is not None:
            self._pending.cancel()

    def _unreachable(self) -> None:
        if self.running:
            self._run(self.machine.connection_failed(self.clock.seconds()))

    def _run(self, effects: list[HealthEffect]) -> None:
        for effect in effects:
            if isinstance(effect, CheckRuntime):
                self._check(effect)
            elif isinstance(effect, ReadinessChanged):
                log.info("runtime at {url} {state}: {reason}", url=self.runtime.root,
                         state="ready" if effect.ready else "not ready", reason=effect.reason)
                self.changed(effect.ready, effect.models)
        if self.running:
            self._timer.arm(self.machine.next_deadline())

    def _check(self, check: CheckRuntime) -> None:
        if self._pending is not None:
            self._pending.cancel()  # the machine abandoned it (timed out)
        headers = Headers({b"User-Agent": [b"infx-engine"]})
        self.runtime.authorize(headers)
        url = (self.runtime.root + check.path).encode("ascii")
        pending: Deferred[object] = self.agent.request(b"GET", url, headers)
        self._pending = pending

        def answered(response: IResponse) -> Deferred[None]:
            if response.code == 401 and self.runtime.credentials is not None:
                self.runtime.credentials.refused()
            body: Deferred[bytes] = Deferred()
            response.deliverBody(CappedBody(body, MAX_CHECK_BODY, truncate=True))
            return body.addCallback(lambda data: self._outcome(
                pending, lambda now: self.machine.check_answered(check.check_id, response.code, data, now)))

        def failed(failure: Failure) -> None:
            reason = failure.getErrorMessage() or failure.type.__name__
            self._outcome(pending, lambda now: self.machine.check_failed(check.check_id, reason, now))

        pending.addCallback(answered)
        pending.addErrback(failed)

    def _outcome(self, pending: Deferred[object], step: Callable[[float], list[HealthEffect]]) -> None:
        if self._pending is pending:
            self._pending = None
        if self.running:
            self._run(step(self.clock.seconds()))
