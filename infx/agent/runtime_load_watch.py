"""The runtime's load on Twisted: performs :class:`protocol.agent.runtime_load.RuntimeLoadMonitor`'s effects.

Every decision (when, which paths, what a body means, when a change is worth
telling the gateway) is the pure monitor's; this service GETs the paths on
the ``openai`` runtime's server (with the runtime's credentials, through
``authorize``), hands the answers back, arms one timer from
``next_deadline()``, and passes each :class:`~protocol.agent.runtime_load.LoadChanged`
to ``changed``. Each scrape is stamped with ``sample()`` as its requests go
out (which of the gateway's tasks the agent had received and seen end), so
that the load read from it says what it includes. Scrapes use a pool of their own, so that they never wait
behind busy task connections, and quiet, so that a scrape a second does not
log a connection factory's start and stop each time.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IResponse

from infx.agent.side_http import CappedBody, quiet_pool
from infx.deadline import DeadlineTimer
from protocol.agent.runtime_load import (
    LoadChanged,
    LoadEffect,
    LoadSample,
    RuntimeLoad,
    RuntimeLoadMonitor,
    ScrapeAnswer,
    ScrapeRuntime,
)
from protocol.agent.runtime_metrics import MAX_BODY

__all__ = ["ReadWhenReady", "RuntimeLoadWatch", "scrape_pool"]

log = Logger(namespace="infx.runtime_load_watch")


def scrape_pool(clock: IReactorTime) -> HTTPConnectionPool:
    """Connections for the scrapes alone: two kept open (``/metrics`` and ``/slots``), quiet."""
    return quiet_pool(clock, 2)


class RuntimeLoadWatch(Service):
    """Scrapes the runtime at ``root`` and calls ``changed(load)`` when its reported load changes.

    ``authorize(headers)`` adds the runtime's credentials to each GET;
    ``refused()`` is called when the runtime answers 401 (its key changed);
    ``sample()`` stamps each scrape (the agent core's ``load_sample``).
    """

    def __init__(self, clock: IReactorTime, monitor: RuntimeLoadMonitor, agent: IAgent, root: str,
                 changed: Callable[[RuntimeLoad | None], None],
                 authorize: Callable[[Headers], None] | None = None,
                 refused: Callable[[], None] | None = None,
                 sample: Callable[[], LoadSample | None] = lambda: None) -> None:
        self.clock = clock
        self.monitor = monitor
        self.agent = agent
        self.root = root.rstrip("/")
        self.changed = changed
        self.authorize = authorize
        self.refused = refused
        self.sample = sample
        self._timer = DeadlineTimer(clock, lambda: self._run(self.monitor.handle_timeout(self.clock.seconds())))
        self._pending: list[Deferred[object]] = []
        self._reporting = False
        #: Waiting for the scrape under way to end (:meth:`runtime_ready`).
        self._read: list[Deferred[None]] = []

    def startService(self) -> None:
        super().startService()
        self._run(self.monitor.start(self.clock.seconds()))

    def stopService(self) -> None:
        super().stopService()
        self._timer.cancel()
        self._cancel_pending()
        self._reading_ended()

    def runtime_ready(self) -> Deferred[None]:
        """The runtime's health check found it ready: its load is read at once. Fires once that
        reading (or the one under way) is taken, has failed or was abandoned: whatever it said of
        the runtime's slots and load has then been passed to ``changed``."""
        if self.running:
            self._run(self.monitor.runtime_ready(self.clock.seconds()))
        if not (self.running and self.monitor.reading):
            return succeed(None)
        read: Deferred[None] = Deferred()
        self._read.append(read)
        return read

    def _reading_ended(self) -> None:
        read, self._read = self._read, []
        for each in read:
            each.callback(None)

    def _cancel_pending(self) -> None:
        pending, self._pending = self._pending, []
        for request in pending:
            request.cancel()

    def _run(self, effects: list[LoadEffect]) -> None:
        for effect in effects:
            if isinstance(effect, ScrapeRuntime):
                self._scrape(effect)
            elif isinstance(effect, LoadChanged):
                if (effect.load is not None) != self._reporting:
                    self._reporting = effect.load is not None
                    if effect.load is not None:
                        log.info("runtime at {url} reports its load ({source} metrics)", url=self.root,
                                 source=effect.load.source)
                    else:
                        log.info("runtime at {url} no longer reports its load; routing counts tasks",
                                 url=self.root)
                self.changed(effect.load)
        if self.running:
            self._timer.arm(self.monitor.next_deadline())
        if self._read and not self.monitor.reading:
            self._reading_ended()

    def _scrape(self, scrape: ScrapeRuntime) -> None:
        self._cancel_pending()  # the monitor abandoned the last one (timed out)
        sample = self.sample()
        gets = [self._get(path) for path in scrape.paths]
        mine = [get for get, _ in gets]
        self._pending = mine
        answers: dict[str, ScrapeAnswer] = {}

        def collect(path: str) -> Callable[[ScrapeAnswer], None]:
            def store(answer: ScrapeAnswer) -> None:
                answers[path] = answer
            return store

        for (get, answered), path in zip(gets, scrape.paths):
            answered.addCallback(collect(path))
        everything: Deferred[object] = DeferredList([answered for _, answered in gets])

        def done(_: object) -> None:
            if self._pending is mine:
                self._pending = []
            if self.running:
                self._run(self.monitor.scrape_done(scrape.scrape_id, answers, sample, self.clock.seconds()))

        everything.addCallback(done)

    def _get(self, path: str) -> tuple[Deferred[object], Deferred[ScrapeAnswer]]:
        """(the request, to cancel it; its answer, which never fails: a failure is ``status`` None)."""
        headers = Headers({b"User-Agent": [b"infx-engine"]})
        if self.authorize is not None:
            self.authorize(headers)
        request: Deferred[object] = self.agent.request(b"GET", (self.root + path).encode("ascii"), headers)
        answered: Deferred[ScrapeAnswer] = Deferred()

        def got(response: IResponse) -> Deferred[None]:
            if response.code == 401 and self.refused is not None:
                self.refused()  # the key may have been rotated: let the credentials reread it
            body: Deferred[bytes] = Deferred()
            response.deliverBody(CappedBody(body, MAX_BODY, truncate=False))
            return body.addCallbacks(
                lambda data: answered.callback(ScrapeAnswer(response.code, data)),
                lambda failure: answered.callback(ScrapeAnswer(None)),
            )

        def failed(failure: Failure) -> None:
            if not answered.called:
                answered.callback(ScrapeAnswer(None))

        request.addCallback(got)
        request.addErrback(failed)
        return request, answered


class ReadWhenReady:
    """A health watch's ``changed`` that has ``load`` read the runtime as it turns ready and tells
    ``changed`` so once that reading is in (taken, failed or abandoned): the runtime's first tasks
    are routed by its slots, not sent while the gateway knows none, and a scrape interval is not
    waited for. A verdict that follows while the reading is under way replaces it; a ready
    runtime's change of models is told at once."""

    def __init__(self, changed: Callable[[bool, tuple[str, ...]], None], load: RuntimeLoadWatch) -> None:
        self.changed = changed
        self.load = load
        self._verdicts = 0
        self._told_ready = False

    def __call__(self, ready: bool, models: tuple[str, ...]) -> None:
        self._verdicts += 1
        if not ready or self._told_ready:
            self._told_ready = ready
            self.changed(ready, models)
            return
        verdict = self._verdicts

        def read(_: None) -> None:
            if verdict == self._verdicts:
                self._told_ready = True
                self.changed(True, models)

        self.load.runtime_ready().addCallback(read)
