"""/admin on a whole gateway in one process: who may read status and events, what a tenant's admin
sees, the live event stream, a key revoked mid-stream, the page's files and their policy."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet import reactor, task, threads

from infx.config import build_config
from infx.service import GatewayService
from tests.support.http_api import raw

KEYS = """\
keys:
  - {key: sk-user, tenant: team-a}
  - {key: sk-a-admin, tenant: team-a, admin: true}
  - {key: sk-b-admin, tenant: team-b, admin: true}
  - {key: sk-root, tenant: ops, admin: cluster}
"""


@pytest.fixture(params=["httptools", "twisted"])
def gateway(tmp_path: Path, request: pytest.FixtureRequest):
    """A gateway on either of its HTTP servers: the operator's view reads the same request from both."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    config = build_config({}, {"http_server": request.param,
                               "http": "tcp:0:interface=127.0.0.1", "worker_grpc": "tcp:0:interface=127.0.0.1",
                               "internal_grpc": "tcp:0:interface=127.0.0.1", "echo_models": "echo",
                               "echo_tenant": "team-a", "api_keys": str(keys)})
    service = GatewayService(reactor, config, pod_name="gw-test")
    service.startService()
    pytest_twisted.blockon(service.when_listening())
    for _ in range(400):
        if service.dispatcher.models("team-a"):
            break
        pytest_twisted.blockon(task.deferLater(reactor, 0.02, lambda: None))
    yield service, f"http://127.0.0.1:{service.http.port.getHost().port}", keys
    pytest_twisted.blockon(service.stopService())


def status_as(base: str, key: str | None, query: str = "") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    code, _, body = raw(base, "GET", "/admin/status" + query, headers=headers)
    return code, json.loads(body)


def first_events(base: str, key: str, count: int) -> tuple[list[dict], http.client.HTTPResponse]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/admin/events", headers={"Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type") == "text/event-stream"
    events, block = [], b""
    while len(events) < count:
        line = response.readline()
        assert line, "the stream ended"
        if line == b"\n":
            if block.startswith(b"event: status\n"):
                events.append(json.loads(block.split(b"data: ", 1)[1]))
            block = b""
        else:
            block += line
    return events, response


@pytest_twisted.inlineCallbacks
def test_status_takes_an_admin_key_and_a_tenants_admin_sees_its_tenant_alone(gateway):
    _, base, _ = gateway
    assert (yield threads.deferToThread(status_as, base, None))[0] == 401
    code, body = yield threads.deferToThread(status_as, base, "sk-user")
    assert code == 403 and body["error"]["code"] == "admin_key_required"
    _, everything = yield threads.deferToThread(status_as, base, "sk-root")
    assert everything["scope"] is None and "team-a" in everything["tenants"]
    code, team_b = yield threads.deferToThread(status_as, base, "sk-b-admin")
    assert code == 200 and team_b["scope"] == "team-b" and list(team_b["tenants"]) == ["team-b"]
    assert team_b["tenants"]["team-b"]["engines"] == {} and "team-a" not in json.dumps(team_b)
    _, team_a = yield threads.deferToThread(status_as, base, "sk-a-admin")
    assert list(team_a["tenants"]["team-a"]["engines"]) == ["builtin-echo-gw-test"]


@pytest_twisted.inlineCallbacks
def test_a_request_is_found_by_id_only_within_the_callers_scope(gateway):
    _, base, _ = gateway
    body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "find me"}]}).encode()
    code, _, _ = yield threads.deferToThread(raw, base, "POST", "/v1/chat/completions", body,
                                             {"Authorization": "Bearer sk-user", "X-Request-ID": "req-42",
                                              "Content-Type": "application/json"})
    assert code == 200
    _, mine = yield threads.deferToThread(status_as, base, "sk-a-admin", "?request=req-42")
    found = mine["request"]
    assert (found["status"], found["tenant"], found["route"]) == (
        200, "team-a", {"gateway": "gw-test", "peer": None, "engine": "builtin-echo-gw-test"})
    assert found["queued_seconds"] is not None and found["retries"] == 0
    _, theirs = yield threads.deferToThread(status_as, base, "sk-b-admin", "?request=req-42")
    assert theirs["request"] is None


@pytest_twisted.inlineCallbacks
def test_events_stream_the_status_every_second_and_end_when_the_key_is_revoked(gateway):
    service, base, keys = gateway
    events, response = yield threads.deferToThread(first_events, base, "sk-a-admin", 2)
    assert [e["scope"] for e in events] == ["team-a", "team-a"]
    assert events[1]["generated_at"] - events[0]["generated_at"] >= 0.9
    keys.write_text(KEYS.replace("  - {key: sk-a-admin, tenant: team-a, admin: true}\n", ""))
    service.key_reload.check()

    def rest() -> bytes:
        return response.read()

    leftover = yield threads.deferToThread(rest)  # ends (no hang) once the key is gone
    assert leftover.count(b"event: status") <= 2


@pytest_twisted.inlineCallbacks
def test_the_page_is_three_files_from_the_package_under_a_policy_that_loads_nothing_else(gateway):
    _, base, _ = gateway
    code, headers, _ = yield threads.deferToThread(raw, base, "GET", "/admin")
    assert code in (301, 302) and headers["location"].endswith("admin/")
    code, headers, page = yield threads.deferToThread(raw, base, "GET", "/admin/")
    assert code == 200 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]
    assert b"http" not in page.replace(b"http-equiv", b"")  # nothing named outside the gateway
    for name, kind in (("admin.js", "text/javascript"), ("admin.css", "text/css")):
        code, headers, body = yield threads.deferToThread(raw, base, "GET", "/admin/" + name)
        assert code == 200 and headers["content-type"].startswith(kind) and b"://" not in body.replace(
            b"http://www.w3.org/2000/svg", b"")
    code, _, body = yield threads.deferToThread(raw, base, "GET", "/admin/nothing-here")
    assert code == 404 and json.loads(body)["error"]["code"] == "unknown_url"
    code, headers, _ = yield threads.deferToThread(raw, base, "POST", "/admin/status")
    assert code == 405 and headers["allow"] == "GET, HEAD"
