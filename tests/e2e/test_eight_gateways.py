"""Issue #16's real-process check: 8 ``twistd infx`` gateways, 16 engines, one killed and restarted.

The cluster (:mod:`harness.eight_gateways`): a full mesh of static peers with an internal secret;
four models, each on four engines attached to four different gateways, so every gateway serves
half the models only through the exchange. With steady traffic from every gateway, one gateway is
SIGKILLed and restarted on its ports: every request to a live gateway ends in one whole, right
answer (those for the lost engines' models fail over), requests to the dead one fail with a
connection error only, and the cluster converges again. Every wait polls with a deadline; the test
asserts outcomes, never durations (``tools/bench/eight_gateways.py`` measures those).
"""

from __future__ import annotations

import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.eight_gateways import (
    ALL_ENGINES,
    ENGINES_PER_GATEWAY,
    MODELS,
    EightGateways,
    GatewayNode,
    Outcome,
    Traffic,
    ask,
    classify,
    cut_on_a_lost_engine,
    engine_model,
    prompt,
)
from harness.twistd_processes import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: Gateway killed and restarted (g3 serves m3 and m0 locally).
VICTIM = 3
#: Long requests each live gateway keeps in flight per model of the victim's engines (whole and
#: streaming each) until it dies.
LONG_PER_MODEL = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EightGateways]:
    c = EightGateways(tmp_path_factory.mktemp("eight-gateways"), token_delay=0.01, status_interval=1.0)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _summary(outcomes: list[Outcome]) -> str:
    kinds = Counter((o.gateway, o.kind) for o in outcomes)
    odd = [o for o in outcomes if o.kind not in ("ok", "connection")][:10]
    return f"{sorted(kinds.items())}; first failures: {odd}"


def test_every_model_answers_from_every_gateway_streaming_and_not(cluster: EightGateways) -> None:
    for node in cluster.gateways:
        assert node.ready_engines() == set(ALL_ENGINES)
        # Half of the models are served here only through a peer.
        assert len(node.local_models()) == 2

    def one(args: tuple[int, str, bool]) -> Outcome:
        index, model, stream = args
        text = prompt(f"all-g{index}-{model}-{stream}")
        with openai.OpenAI(base_url=cluster.gateways[index].base_url, api_key="x", max_retries=0,
                           timeout=30) as client:
            return classify(index, model, stream, text, time.monotonic(), lambda: ask(client, model, text, stream))

    cases = [(g.index, model, stream) for g in cluster.gateways for model in MODELS for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, cases))
    assert all(o.kind == "ok" for o in outcomes), _summary(outcomes)
    for node in cluster.gateways:
        listed = {m.id for m in openai.OpenAI(base_url=node.base_url, api_key="x").models.list().data}
        assert listed == set(MODELS)


def _long_requests(nodes: list[GatewayNode], models: set[str],
                   stop: threading.Event) -> tuple[ThreadPoolExecutor, list[Future[list[Outcome]]]]:
    """From each of ``nodes``, three long requests per model (four seconds of tokens each), whole
    and streaming, each sent again as soon as it ends until ``stop`` (set when the victim dies), so
    that some of each are in flight on any engine of those models when its gateway dies however
    long the test takes to see them there: the whole ones must fail over, the streams started
    there end as cut."""
    cases = [(node, model, stream) for node in nodes for model in sorted(models) for _ in range(LONG_PER_MODEL)
             for stream in (False, True)]
    pool = ThreadPoolExecutor(len(cases))

    def one(node: GatewayNode, model: str, stream: bool) -> Outcome:
        tag = f"long-g{node.index}-{model}-{stream}-{time.monotonic()}"
        text, received = prompt(tag, words=400), list[str]()
        with openai.OpenAI(base_url=node.base_url, api_key="x", max_retries=0, timeout=60) as client:
            return classify(node.index, model, stream, text, time.monotonic(),
                            lambda: ask(client, model, text, stream, tag, received), tag, received)

    def until_stopped(node: GatewayNode, model: str, stream: bool) -> list[Outcome]:
        outcomes = [one(node, model, stream)]
        while not stop.is_set():
            outcomes.append(one(node, model, stream))
        return outcomes

    return pool, [pool.submit(until_stopped, *case) for case in cases]


def _forwarded_to(nodes: list[GatewayNode], engines: set[str]) -> set[str]:
    """Ids of the tasks ``nodes`` have in flight on ``engines`` (another gateway's: the exchange)."""
    ids: set[str] = set()
    for node in nodes:
        try:
            status = node.status()
        except (OSError, urllib.error.URLError):
            continue  # a gateway too busy relaying to answer within the poll's timeout: ask the others
        for engine in status["tenants"]["default"]["engines"].values():
            if engine["engine_id"] in engines:
                ids.update(engine["tasks"])
    return ids


def _long_tasks_on(nodes: list[GatewayNode], engines: set[str]) -> bool:
    """Whether a task of one of ``nodes`` stays on ``engines`` for a second: a long request (the steady
    traffic's take a tenth of that), which must fail over when the engines' gateway dies. Each node is
    asked twice a second apart before the next is asked: under load a round of all seven status
    polls takes longer than a long request lasts, and the same task would not be seen twice."""
    for node in nodes:
        before = _forwarded_to([node], engines)
        if before:
            time.sleep(1.0)
            if before & _forwarded_to([node], engines):
                return True
    return False


def _counter(node: GatewayNode, family_name: str, **labels: str) -> float:
    """The sum of a counter's samples on ``node`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(node.metrics()):
        if family.name == family_name:
            total += sum(s.value for s in family.samples
                         if s.name.endswith("_total") and labels.items() <= s.labels.items())
    return total


def _retries(nodes: list[GatewayNode]) -> float:
    """Re-dispatches the gateways' requests took."""
    return sum(_counter(node, "infx_request_retries") for node in nodes)


def _answered(nodes: list[GatewayNode]) -> dict[int, float]:
    """Chat requests each gateway answered with 200, by its own count."""
    return {node.index: _counter(node, "infx_http_requests", endpoint="chat/completions", status="200")
            for node in nodes}


def test_a_gateway_killed_and_restarted_under_traffic_loses_nothing(cluster: EightGateways) -> None:
    victim = cluster.gateways[VICTIM]
    live = [node for node in cluster.gateways if node is not victim]
    everyone = {node.index for node in cluster.gateways}
    lost = {e for e in ALL_ENGINES if e.startswith(f"e{VICTIM}")}
    retries_before, answered_before = _retries(live), _answered(live)
    traffic = Traffic(cluster).start()
    traffic.wait_answered(everyone, 0.0)
    stop_long = threading.Event()
    pool, long_requests = _long_requests(live, {engine_model(VICTIM, s) for s in range(ENGINES_PER_GATEWAY)},
                                         stop_long)
    try:
        # Kill the victim while its engines work on long requests other gateways forwarded.
        wait_until(lambda: _long_tasks_on(live, lost), "long requests on the victim's engines", cluster.children,
                   timeout=60)
        killed_at = time.monotonic()
        cluster.kill(victim)
        stop_long.set()
        # Its engines leave every other gateway, whose clients keep getting every model.
        wait_until(lambda: cluster.missing(live) == {n.name: lost for n in live},
                   "the live gateways to drop the victim's engines", cluster.children, timeout=30)
        dropped_at = time.monotonic()
        traffic.wait_answered(everyone - {VICTIM}, dropped_at)
        restarted_at = time.monotonic()
        cluster.restart(victim)
        ready_at = time.monotonic()
        converged = cluster.wait_converged(timeout=90)
        print(f"\nrestarted gateway ready {ready_at - restarted_at:.2f}s after its start; "
              f"cluster converged {converged:.2f}s later")
        traffic.wait_answered(everyone, ready_at + converged)
    finally:
        stop_long.set()
        outcomes = traffic.stop()
        outcomes += [o for f in long_requests for o in f.result()]
        pool.shutdown()

    to_live = [o for o in outcomes if o.gateway != VICTIM]
    to_victim = [o for o in outcomes if o.gateway == VICTIM]
    # Nothing lost: every request to a live gateway got its own answer, whole, whatever it was
    # doing when the victim died: requests on the victim's engines failed over to others...
    assert _retries(live) > retries_before
    # ... except a stream already under way on a lost engine, which can only be ended with one
    # error event (its tokens cannot be taken back, nor generated again identically): exactly
    # that, said so to its client and in its gateway's log (see cut_on_a_lost_engine).
    cut = [o for o in to_live if cut_on_a_lost_engine(o, cluster.gateways[o.gateway], killed_at, lost)]
    assert to_live and all(o.kind == "ok" for o in to_live if o not in cut), _summary(to_live)
    assert not [o for o in to_live if not o.stream and o.kind != "ok"]
    assert {o.model for o in to_live if killed_at < o.started < restarted_at} == set(MODELS)
    # The dead gateway's clients saw connection errors only (refused, or cut when it died).
    assert {o.kind for o in to_victim} <= {"ok", "connection"}, _summary(to_victim)
    assert any(o.kind == "connection" for o in to_victim)
    # The restarted gateway serves every model from the moment it listens: none is refused as
    # unknown while its peers' first reports are on their way (see LEARNING in protocol/gateway/core.py).
    assert all(o.kind == "ok" for o in to_victim if o.started > ready_at), _summary(to_victim)
    # Exactly one answer per request: each live gateway counted one 200 per request its clients
    # sent (none answered twice, none dropped), and no task is left anywhere.
    sent = Counter(o.gateway for o in to_live if o.kind == "ok")
    wait_until(lambda: {i: n - answered_before[i] for i, n in _answered(live).items()} == {
        node.index: sent[node.index] for node in live}, "one 200 counted per answered request", timeout=30)
    for node in cluster.gateways:
        wait_until(lambda: node.status()["tasks"] == 0, f"{node.name} to have no task left", timeout=30)
    print(f"{len(outcomes)} requests, {len(cut)} streams cut mid-way on a lost engine, "
          f"{_retries(live) - retries_before:.0f} failovers")
