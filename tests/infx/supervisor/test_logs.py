"""A worker's log lines: twistd's own text, with the worker in the system; its timestamp cached by the second."""

from __future__ import annotations

import io

from twisted.logger import Logger, LogLevel, LogPublisher, formatEventAsClassicLogText, formatTime
from twisted.python.failure import Failure

from infx.supervisor.logs import CachedTime, text_line, text_observer, worker_system


def events() -> list[dict]:
    collected: list[dict] = []
    log = Logger(namespace="infx.request_log", observer=LogPublisher(collected.append))
    log.info("{text}", text="request r1 chat/completions status=200\nsecond line", status=200)
    log.warn("engine {engine_id} gone: {reason!r}", engine_id="gpu-0", reason="lost")
    try:
        1 / 0
    except ZeroDivisionError:
        log.failure("the gateway failed to handle {path}", Failure(), path="/v1/x")
    return collected


def test_every_line_is_twisteds_own_text_with_the_worker_in_its_system():
    when = CachedTime()
    for event in events():
        expected = formatEventAsClassicLogText({**event, "log_system": worker_system(3, event)})
        assert text_line(dict(event), 3, when) == expected
    assert worker_system(1, {"log_namespace": "infx.service", "log_level": LogLevel.info}) == \
        "worker-1 infx.service#info"
    assert worker_system(1, {"log_system": "-", "log_namespace": "log_legacy", "log_level": LogLevel.info}) == \
        "worker-1 log_legacy#info"
    assert worker_system(1, {"log_system": "HTTPChannel,3,127.0.0.1"}) == "worker-1 HTTPChannel,3,127.0.0.1"


def test_the_timestamp_is_twisteds_and_computed_once_a_second():
    when = CachedTime()
    assert when(1796186566.25) == formatTime(1796186566.25) == when(1796186566.99)
    assert when(1796186567.0) == formatTime(1796186567.0)
    assert when(None) == "-"


def test_the_observer_writes_one_line_per_event():
    out = io.StringIO()
    observer = text_observer(out, 0)
    for event in events():
        observer(event)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("[worker-0 infx.request_log#info] request r1 chat/completions status=200")
    assert lines[1] == "\tsecond line"
    assert "[worker-0 infx.request_log#warn] engine gpu-0 gone: 'lost'" in lines[2]
    assert "ZeroDivisionError" in out.getvalue()
