"""The runtime health check as pure code, with a hand-stepped clock."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.agent.runtime_health import (
    CheckRuntime,
    HealthConfig,
    HealthState,
    HealthUsageError,
    ReadinessChanged,
    RuntimeHealth,
    listed_models,
)

T0 = 50.0
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}, {"id": "big"}]}).encode()


def check(effects: list[object]) -> CheckRuntime:
    checks = [e for e in effects if isinstance(e, CheckRuntime)]
    assert len(checks) == 1, effects
    return checks[0]


def changes(effects: list[object]) -> list[ReadinessChanged]:
    return [e for e in effects if isinstance(e, ReadinessChanged)]


def test_starts_unknown_checks_health_at_once_and_is_ready_once_it_answers():
    h = RuntimeHealth(HealthConfig())
    first = check(h.start(T0))
    assert first.path == "/health" and not h.ready and h.state is HealthState.UNKNOWN
    assert changes(h.check_answered(first.check_id, 200, b"", T0 + 0.1)) == [
        ReadinessChanged(True, (), "/health answered")]
    assert h.ready and h.next_deadline() == T0 + 0.1 + 5.0


def test_a_runtime_without_health_is_checked_with_v1_models_for_good():
    h = RuntimeHealth(HealthConfig())
    first = check(h.start(T0))
    second = check(h.check_answered(first.check_id, 404, b"Not Found", T0))
    assert second.path == "/v1/models" and not h.ready
    assert changes(h.check_answered(second.check_id, 200, MODELS, T0))[0].ready
    third = check(h.handle_timeout(T0 + 5))
    assert third.path == "/v1/models"


def test_a_runtime_with_neither_endpoint_is_up_while_it_answers_http_at_all():
    h = RuntimeHealth(HealthConfig())
    first = check(h.start(T0))
    second = check(h.check_answered(first.check_id, 404, b"", T0))
    assert changes(h.check_answered(second.check_id, 404, b"", T0))[0].ready
    third = check(h.handle_timeout(T0 + 5))
    assert changes(h.check_failed(third.check_id, "connection refused", T0 + 5))[0].ready is False


def test_listing_models_from_a_runtime_without_v1_models_is_down():
    h = RuntimeHealth(HealthConfig(list_models=True))
    first = check(h.start(T0))
    assert changes(h.check_answered(first.check_id, 404, b"", T0))[0].ready is False


def test_a_loading_runtime_is_down_and_checked_more_often_until_it_answers():
    h = RuntimeHealth(HealthConfig(interval=5, down_interval=1))
    first = check(h.start(T0))
    went_down = changes(h.check_answered(first.check_id, 503, b'{"status":"loading model"}', T0))
    assert went_down == [ReadinessChanged(False, (), "/health answered 503")]
    assert h.next_deadline() == T0 + 1
    assert h.handle_timeout(T0 + 0.5) == []
    second = check(h.handle_timeout(T0 + 1))
    assert h.check_failed(second.check_id, "connection refused", T0 + 1) == []  # still down: no change
    third = check(h.handle_timeout(T0 + 2))
    assert changes(h.check_answered(third.check_id, 200, b"", T0 + 2))[0].ready


def test_a_check_that_does_not_answer_in_time_fails_and_its_late_answer_is_ignored():
    h = RuntimeHealth(HealthConfig(timeout=2))
    first = check(h.start(T0))
    h.check_answered(first.check_id, 200, b"", T0)
    second = check(h.handle_timeout(T0 + 5))
    assert h.next_deadline() == T0 + 7
    assert changes(h.handle_timeout(T0 + 7)) == [ReadinessChanged(False, (), "/health did not answer within 2s")]
    assert h.check_answered(second.check_id, 200, b"", T0 + 7.5) == [] and not h.ready


def test_a_connection_error_of_a_task_checks_at_once_but_never_twice_at_a_time():
    h = RuntimeHealth(HealthConfig())
    first = check(h.start(T0))
    assert h.connection_failed(T0) == []  # a check is on its way
    h.check_answered(first.check_id, 200, b"", T0)
    second = check(h.connection_failed(T0 + 1))
    assert changes(h.check_failed(second.check_id, "connection refused", T0 + 1)) == [
        ReadinessChanged(False, (), "connection refused")]


def test_listing_models_reports_them_and_their_changes():
    h = RuntimeHealth(HealthConfig(list_models=True))
    first = check(h.start(T0))
    assert first.path == "/v1/models"
    assert changes(h.check_answered(first.check_id, 200, MODELS, T0)) == [
        ReadinessChanged(True, ("tiny", "big"), "/v1/models answered")]
    second = check(h.handle_timeout(T0 + 5))
    assert h.check_answered(second.check_id, 200, MODELS, T0 + 5) == []  # nothing changed
    third = check(h.handle_timeout(T0 + 10))
    only_tiny = json.dumps({"data": [{"id": "tiny"}]}).encode()
    assert changes(h.check_answered(third.check_id, 200, only_tiny, T0 + 10))[0].models == ("tiny",)
    fourth = check(h.handle_timeout(T0 + 15))
    # Down: the models last listed are kept (reported not ready), so requests for them wait.
    assert changes(h.check_failed(fourth.check_id, "reset", T0 + 15)) == [ReadinessChanged(False, ("tiny",), "reset")]


def test_listing_models_needs_a_model_list_in_the_answer():
    h = RuntimeHealth(HealthConfig(list_models=True))
    first = check(h.start(T0))
    assert changes(h.check_answered(first.check_id, 200, b"<html>ok</html>", T0))[0].ready is False


@given(st.binary(max_size=200))
def test_listed_models_never_raises_on_any_body(body):
    result = listed_models(body)
    assert result is None or all(isinstance(m, str) and m for m in result)


def test_config_and_misuse_are_refused():
    with pytest.raises(HealthUsageError):
        HealthConfig(interval=0)
    h = RuntimeHealth(HealthConfig())
    h.start(T0)
    with pytest.raises(HealthUsageError):
        h.start(T0)
