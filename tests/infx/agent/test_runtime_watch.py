"""The runtime's health check and credentials on Twisted, against a twisted.web runtime on loopback.

The schedule runs on a ``task.Clock`` stepped by hand; the HTTP exchanges are
real (a loopback server, Twisted's ``Agent``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.web import resource, server
from twisted.web.client import Agent, HTTPConnectionPool

from infx.agent.runtime_watch import RuntimeWatch
from infx.agent.runtime_client import RuntimeClient
from infx.agent.runtimes import OpenAIRuntime
from infx.agent.upstream_key import UpstreamKey, UpstreamKeyError, read_key_file
from protocol.agent.runtime_health import HealthConfig, RuntimeHealth
from tests.support.runtimes import Sink, chat_task as _chat_task


class Runtime(resource.Resource):
    """A runtime whose health, model list and key the test sets; it records each request's path
    and ``Authorization``."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.health: int | None = 200  # None: no /health endpoint (404)
        self.models = ["tiny"]
        self.key: str | None = None
        self.seen: list[tuple[bytes, bytes | None]] = []

    def _answer(self, request: server.Request, status: int, body: object) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(body).encode()

    def render(self, request: server.Request) -> bytes:
        authorization = request.getHeader(b"authorization")
        self.seen.append((request.path, authorization))
        if self.key is not None and authorization != f"Bearer {self.key}".encode():
            return self._answer(request, 401, {"error": {"message": "Invalid API key"}})
        if request.path == b"/health" and self.health is not None:
            return self._answer(request, self.health, {})
        if request.path == b"/v1/models":
            return self._answer(request, 200, {"object": "list", "data": [{"id": m} for m in self.models]})
        if request.path == b"/v1/chat/completions":
            return self._answer(request, 200, {"object": "chat.completion", "choices": []})
        return self._answer(request, 404, {"error": {"message": "no route"}})


@pytest.fixture
def runtime_server():
    fake = Runtime()
    port = pytest_twisted.blockon(TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server.Site(fake)))
    pool = HTTPConnectionPool(reactor, persistent=False)
    yield fake, f"http://127.0.0.1:{port.getHost().port}", Agent(reactor, pool=pool)
    pytest_twisted.blockon(defer.maybeDeferred(port.stopListening))


class Watched:
    """A RuntimeWatch on a stepped clock, with every readiness change it reported."""

    def __init__(self, agent: Agent, url: str, *, list_models: bool = False, credentials: UpstreamKey | None = None,
                 clock: task.Clock | None = None) -> None:
        self.clock = clock or task.Clock()
        self.runtime = OpenAIRuntime(self.clock, RuntimeClient(reactor, url), url, credentials=credentials)
        self.changes: list[tuple[bool, tuple[str, ...]]] = []
        machine = RuntimeHealth(HealthConfig(interval=5, down_interval=1, timeout=3, list_models=list_models))
        self.watch = RuntimeWatch(self.clock, machine, agent, self.runtime,
                                  lambda ready, models: self.changes.append((ready, models)))


def chat_task():
    """A chat task whose client sent its own ``Authorization`` (which must never reach the runtime)."""
    return _chat_task("hi", model="tiny")


@defer.inlineCallbacks
def until(predicate, what: str):
    """Let the reactor run until ``predicate()`` holds (the HTTP exchanges are real)."""
    for _ in range(500):
        if predicate():
            return
        yield task.deferLater(reactor, 0.01, lambda: None)
    raise AssertionError(f"timed out waiting for {what}")


@pytest_twisted.inlineCallbacks
def test_ready_once_health_answers_not_ready_while_it_fails_and_ready_again(runtime_server):
    fake, url, agent = runtime_server
    w = Watched(agent, url)
    w.watch.startService()
    yield until(lambda: w.changes, "the first check")
    assert w.changes == [(True, ())]
    fake.health = 503  # llama.cpp's server while it loads a model
    w.clock.advance(5)
    yield until(lambda: len(w.changes) == 2, "the second check")
    assert w.changes[-1] == (False, ())
    fake.health = 200
    w.clock.advance(1)  # checked every second while down
    yield until(lambda: len(w.changes) == 3, "the third check")
    assert w.changes[-1] == (True, ())
    w.watch.stopService()


@pytest_twisted.inlineCallbacks
def test_a_runtime_without_health_is_checked_at_v1_models_and_lists_its_models(runtime_server):
    fake, url, agent = runtime_server
    fake.health = None
    fake.models = ["tiny", "big"]
    w = Watched(agent, url, list_models=True)
    w.watch.startService()
    yield until(lambda: w.changes, "the first check")
    assert [path for path, _ in fake.seen] == [b"/v1/models"]
    assert w.changes == [(True, ("tiny", "big"))]
    w.watch.stopService()


@pytest_twisted.inlineCallbacks
def test_a_task_that_cannot_reach_the_runtime_triggers_a_check_at_once():
    clock = task.Clock()
    # Nobody listens there: the task's connection is refused, and so is the check that follows.
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server.Site(resource.Resource()))
    url = f"http://127.0.0.1:{port.getHost().port}"
    yield defer.maybeDeferred(port.stopListening)
    w = Watched(Agent(reactor), url, clock=clock)
    w.watch.startService()
    yield until(lambda: w.changes, "the first check")
    assert w.changes == [(False, ())]
    assert w.watch.machine.next_deadline() == 1.0  # the next check, a second later
    sink = Sink()
    w.runtime.start(chat_task(), sink)
    # Read as the task ends: a check is on its way now (its timeout is the next deadline).
    deadline = yield sink.done.addCallback(lambda _: w.watch.machine.next_deadline())
    assert sink.head.status_code == 503
    assert deadline == 3.0, "the connection error started a check at once"
    w.watch.stopService()


@pytest_twisted.inlineCallbacks
def test_the_key_goes_to_tasks_and_checks_and_a_rotated_secret_is_used_without_restart(runtime_server, tmp_path):
    fake, url, agent = runtime_server
    fake.key = "key-one"
    # A Kubernetes Secret volume: the file is a symlink through ..data, which the kubelet swaps.
    first = tmp_path / "..2026_12_01_a"
    first.mkdir()
    (first / "api-key").write_text("key-one\n")
    os.symlink(first.name, tmp_path / "..data")
    os.symlink("..data/api-key", tmp_path / "api-key")
    clock = task.Clock()
    credentials = UpstreamKey(clock, path=str(tmp_path / "api-key"), interval=10)
    w = Watched(agent, url, credentials=credentials, clock=clock)
    w.watch.startService()
    yield until(lambda: w.changes, "the first check")
    assert w.changes == [(True, ())] and fake.seen[-1] == (b"/health", b"Bearer key-one")
    sink = Sink()
    w.runtime.start(chat_task(), sink)
    yield sink.done
    assert sink.head.status_code == 200 and fake.seen[-1] == (b"/v1/chat/completions", b"Bearer key-one")

    second = tmp_path / "..2026_12_01_b"
    second.mkdir()
    (second / "api-key").write_text("key-two\n")
    os.symlink(second.name, tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    fake.key = "key-two"
    # Before the reread interval the old key is still sent, and refused: that makes the next request reread.
    sink = Sink()
    w.runtime.start(chat_task(), sink)
    yield sink.done
    assert sink.head.status_code == 401
    sink = Sink()
    w.runtime.start(chat_task(), sink)
    yield sink.done
    assert sink.head.status_code == 200 and fake.seen[-1] == (b"/v1/chat/completions", b"Bearer key-two")
    w.watch.stopService()


def test_a_key_file_is_reread_after_its_interval_and_a_broken_one_keeps_the_last_key(tmp_path):
    clock = task.Clock()
    path = tmp_path / "key"
    path.write_text("  sk-1 \n")
    key = UpstreamKey(clock, path=str(path), interval=10)
    assert key.current() == "sk-1"
    path.write_text("sk-2")
    clock.advance(9)
    assert key.current() == "sk-1"
    clock.advance(1)
    assert key.current() == "sk-2"
    path.write_text("")
    clock.advance(10)
    assert key.current() == "sk-2"


@pytest.mark.parametrize("content, problem", [(b"", "empty"), (b"a b", "whitespace"), (b"\xff", "non-ASCII")])
def test_an_unusable_key_file_is_refused_with_its_reason(tmp_path: Path, content: bytes, problem: str):
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(UpstreamKeyError, match=problem):
        read_key_file(str(path))
    with pytest.raises(UpstreamKeyError, match="cannot read"):
        read_key_file(str(tmp_path / "missing"))
