"""The runtime's health check on Twisted: performs :class:`protocol.agent.runtime_health.RuntimeHealth`'s effects.

Every decision (when, which path, what an answer means) is the pure
machine's; this service GETs the path on the ``openai`` runtime's server
(with its credentials), reports the outcome, arms one timer from
``next_deadline()``, and tells the engine agent when readiness changes.
A task that could not reach the runtime triggers a check at once, through
:attr:`infx.agent.runtimes.OpenAIRuntime.on_unreachable`. Each time the
runtime turns ready it is asked once what it is
(:mod:`protocol.agent.runtime_identity`), and :attr:`RuntimeWatch.identified`
hears the answer.
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
from protocol.agent.runtime_identity import IDENTITY_PATHS, identity_of

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
        #: Called with (kind, version) when the runtime, turned ready, says what it is.
        self.identified: Callable[[str, str], None] | None = None
        self._identifying: Deferred[None] | None = None
        runtime.on_unreachable.append(self._unreachable)

    def startService(self) -> None:
        super().startService()
        self._run(self.machine.start(self.clock.seconds()))

    def stopService(self) -> None:
        super().stopService()
        self._timer.cancel()
        if self._pending is not None:
            self._pending.cancel()
        if self._identifying is not None:
            self._identifying.cancel()

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
                if effect.ready and self.identified is not None and self._identifying is None:
                    self._identifying = Deferred.fromCoroutine(self._identify())
                    self._identifying.addErrback(lambda _: None)  # cancelled on stop
        if self.running:
            self._timer.arm(self.machine.next_deadline())

    async def _identify(self) -> None:
        """Ask the runtime's identity paths in turn until one names it (a failure is no answer)."""
        try:
            for path in IDENTITY_PATHS:
                headers = Headers({b"User-Agent": [b"infx-engine"]})
                self.runtime.authorize(headers)
                try:
                    response = await self.agent.request(b"GET", (self.runtime.root + path).encode("ascii"), headers)
                    body: Deferred[bytes] = Deferred()
                    response.deliverBody(CappedBody(body, MAX_CHECK_BODY, truncate=False))
                    found = identity_of(path, response.code, await body)
                except Exception:
                    found = None
                if found is not None and self.identified is not None and self.running:
                    self.identified(*found)
                    return
        finally:
            self._identifying = None

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
