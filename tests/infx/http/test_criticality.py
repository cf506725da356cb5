"""Request criticality and caller shares: from the key file and the x-infx-criticality header to
the processor's queue, and sheddable requests refused first through a whole gateway (issue #17)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
import pytest_twisted
from twisted.internet import threads

from infx.config import ConfigError, build_config
from infx.gateway.auth import KeyFileError, KeyStore
from protocol.agent.echo import echo_task
from protocol.processor.core import ProcessorConfig
from protocol.processor.fair_queue import Criticality, CriticalityRefused, requested_criticality
from tests.support.hostile import CHAT, ECHO, JSON, Stack
from tests.support.http_api import gateway_factory, raw  # noqa: F401 (gateway_factory is a fixture)

CRITICAL, STANDARD, SHEDDABLE = Criticality.CRITICAL, Criticality.STANDARD, Criticality.SHEDDABLE


@pytest.mark.parametrize(("allowed", "admin", "header", "expected"), [
    (STANDARD, False, None, STANDARD),
    (STANDARD, False, "", STANDARD),
    (STANDARD, False, "sheddable", SHEDDABLE),
    (CRITICAL, False, "Standard", STANDARD),
    (SHEDDABLE, True, "critical", CRITICAL),
    (STANDARD, False, "standard", STANDARD),
])
def test_the_header_may_lower_the_keys_criticality_and_an_admin_may_set_any(allowed, admin, header, expected):
    assert requested_criticality(allowed, admin, header) is expected


@pytest.mark.parametrize(("allowed", "header", "problem"), [
    (STANDARD, "critical", "allows criticality standard at most"),
    (SHEDDABLE, "standard", "allows criticality sheddable at most"),
    (STANDARD, "urgent", "critical, standard or sheddable"),
])
def test_asking_for_more_than_the_key_allows_or_for_nonsense_is_refused(allowed, header, problem):
    with pytest.raises(CriticalityRefused, match=problem):
        requested_criticality(allowed, False, header)


def test_key_file_members_set_criticality_and_weight():
    keys = KeyStore.from_mapping({"keys": [
        {"key": "sk-batch", "tenant": "t", "name": "batch", "criticality": "sheddable", "weight": 0.5},
        {"key": "sk-prod", "tenant": "t", "criticality": "critical", "weight": 4},
        {"key": "sk-plain", "tenant": "t"},
    ]})
    batch, prod, plain = (keys.client(f"Bearer sk-{k}") for k in ("batch", "prod", "plain"))
    assert (batch.criticality, batch.weight, batch.key_id) == (SHEDDABLE, 0.5, "batch")
    assert (prod.criticality, prod.weight) == (CRITICAL, 4.0)
    assert (plain.criticality, plain.weight) == (STANDARD, 1.0)


@pytest.mark.parametrize(("member", "problem"), [
    ({"criticality": "urgent"}, "criticality must be critical, standard or sheddable"),
    ({"criticality": 3}, "criticality must be"),
    ({"weight": 0}, "weight must be a number from 0.001 to 1000"),
    ({"weight": "heavy"}, "weight must be a number from 0.001 to 1000"),
    ({"weight": True}, "weight must be a number from 0.001 to 1000"),
    ({"weight": 1e-320}, "weight must be a number from 0.001 to 1000"),
    ({"weight": 1e6}, "weight must be a number from 0.001 to 1000"),
])
def test_bad_criticality_or_weight_in_the_key_file_is_an_error_naming_the_entry(member, problem):
    with pytest.raises(KeyFileError, match=rf"keys\[0\]: {problem}"):
        KeyStore.from_mapping({"keys": [{"key": "sk", "tenant": "t", **member}]})


def test_the_gateway_option_is_validated():
    assert build_config({}, {"shed-waiting-threshold": "4"}).shed_waiting_threshold == 4
    assert build_config({}, {"fair-reserve": "0"}).fair_reserve == 0
    assert build_config({}, {}).fair_reserve == ProcessorConfig().fair_reserve
    with pytest.raises(ConfigError, match="fair-reserve"):
        build_config({}, {"fair-reserve": "-1"})
    with pytest.raises(ConfigError, match="shed-waiting-threshold"):
        build_config({}, {"shed-waiting-threshold": "-1"})


def ask(base, key, header=None):
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    if header is not None:
        headers["x-infx-criticality"] = header
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    return threads.deferToThread(raw, base, "POST", "/v1/chat/completions", body, headers)


@pytest_twisted.inlineCallbacks
def test_the_gateway_hands_the_runner_the_requests_criticality_caller_and_share(gateway_factory):  # noqa: F811
    keys = KeyStore.from_mapping({"keys": [
        {"key": "sk-a", "tenant": "t", "name": "team-a", "weight": 2},
        {"key": "sk-admin", "tenant": "t", "admin": True, "criticality": "sheddable"},
    ]})
    runner, _, base = yield gateway_factory(keys=keys)
    status, _, _ = yield ask(base, "sk-a")
    assert status == 200
    first = runner.submissions[-1]
    assert (first.criticality, first.flow, first.weight) == (STANDARD, "team-a", 2.0)
    status, _, _ = yield ask(base, "sk-a", "sheddable")
    assert status == 200 and runner.submissions[-1].criticality is SHEDDABLE
    status, _, body = yield ask(base, "sk-a", "critical")
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == "invalid_criticality" and "x-infx-criticality" in error["message"]
    status, _, _ = yield ask(base, "sk-admin", "critical")
    assert status == 200 and runner.submissions[-1].criticality is CRITICAL
    assert len(runner.submissions) == 3  # the refused request never became a task


def test_a_sheddable_request_to_saturated_engines_gets_429_with_retry_after_and_a_standard_one_waits():
    """One engine at its cap of one task: a sheddable request is refused at once (429,
    Retry-After), a standard one waits and is served once the slot frees."""
    keys = KeyStore.from_mapping({"keys": [
        {"key": "sk-batch", "tenant": "t", "criticality": "sheddable"},
        {"key": "sk-app", "tenant": "t"},
    ]})
    stack = Stack(keys=keys, processor=ProcessorConfig(
        queue_timeout=5, max_task_duration=60, max_in_flight_per_engine=1, busy_retry_after=4))
    engine = stack.engine("e1", tenant="t", hold=True)
    as_app = {**JSON, "authorization": "Bearer sk-app"}
    holding, waiting = stack.connect(), stack.connect()
    holding.request("/v1/chat/completions", CHAT, as_app)
    stack.settle(1)
    assert len(engine.tasks) == 1
    shed = stack.connect().exchange("/v1/chat/completions", CHAT, {**JSON, "authorization": "Bearer sk-batch"})
    assert shed.status == 429 and shed.headers[b"retry-after"] == b"4"
    assert "sheddable" in shed.error()["message"]
    waiting.request("/v1/chat/completions", CHAT, as_app)
    stack.settle(1)
    assert stack.processor.waiting_counts() == {("t", "m"): 1}
    engine.hold = False
    [held] = engine.tasks
    for result in echo_task(held, ECHO, 0.0):  # the engine answers the held task; the waiting one follows
        stack.dispatcher.result_received(engine, result.result)
    stack.settle(1)
    for c in (holding, waiting):
        (response,) = c.responses()
        assert response.status == 200
    stack.metrics.watch(stack.dispatcher.gauges, lambda: stack.processor.counters)
    assert b"infx_sheddable_refusals_total 1.0" in generate_latest(stack.metrics.registry)
