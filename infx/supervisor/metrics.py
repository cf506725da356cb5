"""``/metrics`` of a worker: every worker's series in one scrape, each labelled with its ``worker``.

The HTTP port is shared, so a scrape reaches one worker, whichever the kernel picks. That
worker answers with its own registry and, read over loopback from each sibling's private
metrics port, theirs; every sample gets a ``worker`` label (``"0"`` to ``"N-1"``), so each
series stays one process's (a counter of a worker that restarted starts again at 0, which
Prometheus reads as a reset of that series alone). ``sum without (worker) (...)`` gives the
gateway's whole. A sibling that does not answer in time (it is restarting) is left out of
that scrape, and ``infx_workers_scraped`` says how many answered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer
from twisted.web.client import Agent, HTTPConnectionPool, readBody

__all__ = ["EveryWorkerMetrics", "labelled"]

#: Seconds a sibling's metrics may take before a scrape goes on without them.
SIBLING_TIMEOUT = 2.0


class EveryWorkerMetrics:
    """Calling it gives (a Deferred of) the exposition text of every worker's metrics."""

    def __init__(self, reactor: Any, registry: CollectorRegistry, index: int, ports: Sequence[int]) -> None:
        self.reactor = reactor
        self.registry = registry
        self.index = index
        self.ports = tuple(ports)
        # Persistent: one connection per sibling, not one (and a log line) per scrape.
        self._agent = Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=True))

    @defer.inlineCallbacks
    def __call__(self) -> Any:
        texts = yield defer.DeferredList(
            [self._read(port) for i, port in enumerate(self.ports) if i != self.index], consumeErrors=True)
        families: list[tuple[str, Iterable[Metric]]] = [(str(self.index), self.registry.collect())]
        others = [i for i in range(len(self.ports)) if i != self.index]
        for worker, (ok, text) in zip(others, texts):
            if ok:
                families.append((str(worker), text_string_to_metric_families(text)))
        scraped = Metric("infx_workers_scraped", "Workers whose metrics this scrape holds.", "gauge")
        scraped.add_sample("infx_workers_scraped", {}, float(1 + sum(1 for ok, _ in texts if ok)))
        return render([scraped, *labelled(families)])

    def _read(self, port: int) -> defer.Deferred[str]:
        d = self._agent.request(b"GET", b"http://127.0.0.1:%d/metrics" % port)
        d.addCallback(readBody)
        d.addCallback(lambda body: body.decode("utf-8"))
        timer = self.reactor.callLater(SIBLING_TIMEOUT, d.cancel)
        d.addBoth(lambda result: (timer.active() and timer.cancel(), result)[1])
        return d


def labelled(families: Iterable[tuple[str, Iterable[Metric]]]) -> list[Metric]:
    """The families of every worker merged by name, each sample with its worker's label."""
    merged: dict[str, Metric] = {}
    for worker, metrics in families:
        for metric in metrics:
            into = merged.get(metric.name)
            if into is None:
                into = merged[metric.name] = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            into.samples.extend(sample._replace(labels={**sample.labels, "worker": worker})
                                for sample in metric.samples)
    return list(merged.values())


class _Fixed:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


def render(metrics: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(metrics))  # type: ignore[arg-type]
    return generate_latest(registry)
