"""Safe defaults and what the start-up says (issue 22 items 4 and 5), on real processes.

``tools/run`` listens on loopback only and says so; a gateway without a key file says at
start that auth is off, one with a key file how many keys it loaded; a tenant's admin key
sees its tenant in ``/admin/status`` and only a cluster admin key (``admin: cluster``) sees
every tenant; the internal secret can come from a file or the environment, so that it is
not in ``ps``; the agent refuses a URL for ``--server`` with what to write instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.twistd_processes import (
    ROOT,
    TWISTD,
    Engine,
    Gateway,
    gateway_ports,
    http_get,
    supervisor_ports,
    wait_until,
)


def test_tools_run_listens_on_loopback_only_and_says_that_auth_is_off(tmp_path: Path):
    log = tmp_path / "tools-run.log"
    with log.open("wb") as out:
        # Ports as bare numbers, as a user would give them (0: the kernel's pick, which nobody can
        # take first); tools/run picks the interface.
        process = subprocess.Popen([str(ROOT / "tools" / "run"), "--http", "0", "--worker-grpc", "0",
                                    "--internal-grpc", "0"], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        # Under --workers (the cores, by default) the supervisor says where its workers listen, and each
        # worker says where it does, in any order: the line naming worker 0's internal port is its own.
        def bound() -> tuple[int, int, int] | None:
            said = log.read_text() if process.poll() is None else ""
            workers = supervisor_ports(said)
            return (workers[0], workers[1], workers[2][0]) if workers else gateway_ports(said)

        ports = wait_until(bound, "tools/run's gateway to bind its ports")
        wait_until(lambda: process.poll() is None and f"peers on 127.0.0.1:{ports[2]}" in log.read_text(),
                   "tools/run's gateway to listen")
        said = log.read_text()
        assert "tools/run: listening on 127.0.0.1 only (auth is off); --interface 0.0.0.0 listens on every " \
               "interface" in said
        assert (f"listening: HTTP API on 127.0.0.1:{ports[0]}, engines on 127.0.0.1:{ports[1]}, "
                f"peers on 127.0.0.1:{ports[2]}") in said
        assert "auth is off (no --api-keys): every caller is in the default tenant, engines need no key, " \
               "and /admin/status is open" in said
        assert http_get(f"http://127.0.0.1:{ports[0]}/readyz")[0] == 200
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


KEYS = """
keys:
  - {key: sk-a-admin, tenant: team-a, admin: true}
  - {key: sk-b-admin, tenant: team-b, admin: true}
  - {key: sk-a, tenant: team-a}
  - {key: sk-ops, tenant: ops, admin: cluster}
engine_keys:
  - {key: ek-b, tenant: team-b}
"""


@pytest.fixture
def two_tenants(tmp_path: Path) -> Iterator[Gateway]:
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    gateway = Gateway(tmp_path, api_keys=keys, admin_key="sk-ops", extra=["--echo-models", "echo-a",
                                                                          "--echo-tenant", "team-a"])
    engine = None
    try:
        engine = Engine(tmp_path, gateway, "b-engine", ["model-b"], key="ek-b", tenant="team-b")
        gateway.wait_for_engine(gateway.builtin_engine_id, "team-a", [engine.child])
        yield gateway
    finally:
        for child in (engine, gateway):
            if child is not None:
                child.stop()


def admin_status(gateway: Gateway, key: str) -> tuple[int, dict]:
    code, body = http_get(gateway.url + "/admin/status", {"Authorization": f"Bearer {key}"})
    return code, json.loads(body)


def test_a_tenant_admin_sees_its_tenant_only_and_a_cluster_admin_every_tenant(two_tenants: Gateway):
    gateway = two_tenants
    code, team_a = admin_status(gateway, "sk-a-admin")
    assert code == 200 and list(team_a["tenants"]) == ["team-a"]
    assert list(team_a["tenants"]["team-a"]["engines"]) == [gateway.builtin_engine_id]
    code, team_b = admin_status(gateway, "sk-b-admin")
    assert code == 200 and list(team_b["tenants"]) == ["team-b"]
    assert list(team_b["tenants"]["team-b"]["engines"]) == ["b-engine"]
    code, everything = admin_status(gateway, "sk-ops")
    assert code == 200 and sorted(everything["tenants"]) == ["team-a", "team-b"]
    code, refused = admin_status(gateway, "sk-a")
    assert code == 403 and "admin" in refused["error"]["message"]
    said = gateway.child.output()
    assert "API keys: loaded 4 client and 1 engine key(s) from" in said and "auth is off" not in said


def test_the_internal_secret_comes_from_a_file_or_the_environment_and_never_shows_in_ps(tmp_path: Path):
    secret = "s3cret-from-a-mounted-file"
    path = tmp_path / "internal-secret"
    path.write_text(secret + "\n")  # as a Secret's file may end
    a = Gateway(tmp_path, name="a", extra=["--internal-secret-file", str(path), "--status-interval", "0.5"])
    b = c = None
    try:
        b = Gateway(tmp_path, name="b", env={"INFX_INTERNAL_SECRET": secret}, extra=[
            "--peers", f"127.0.0.1:{a.internal_port}", "--echo-models", "from-b", "--status-interval", "0.5"])
        wait_until(lambda: "from-b" in http_get(a.base_url + "/models")[1].decode(), "a to learn b's model",
                   [a.child, b.child])
        for child in (a.child, b.child):
            assert secret not in Path(f"/proc/{child.process.pid}/cmdline").read_bytes().decode(errors="replace")
        # The wrong secret, from the environment too, is refused as before.
        c = Gateway(tmp_path, name="c", env={"INFX_INTERNAL_SECRET": "wrong"}, wait=False, extra=[
            "--peers", f"127.0.0.1:{a.internal_port}", "--echo-models", "from-c"])
        wait_until(lambda: "refused our internal secret" in c.child.output(), "c to be refused", [a.child, c.child])
        assert "from-c" not in http_get(a.base_url + "/models")[1].decode()
    finally:
        for child in (c, b):
            if child is not None:
                child.stop()
        a.stop()


def test_a_secret_given_twice_or_unreadable_is_a_one_line_usage_error(tmp_path: Path):
    path = tmp_path / "secret"
    path.write_text("x y\n")
    cases = [(["--internal-secret-file", str(path)], "must be printable ASCII without spaces"),
             (["--internal-secret-file", str(tmp_path / "missing")], "--internal-secret-file: cannot read"),
             (["--internal-secret", "a", "--internal-secret-file", str(path)], "give the secret once")]
    for args, message in cases:
        result = subprocess.run([TWISTD, "-n", "--pidfile=", "infx", *args], capture_output=True, text=True,
                                timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        (line,) = result.stderr.splitlines()
        assert message in line, (args, line)


@pytest.mark.parametrize("server, advice", [
    ("http://localhost:18082", "write --server localhost:18082"),
    ("https://gateway.example:443", "write --tls --server gateway.example:443"),
])
def test_the_agent_refuses_a_url_for_server_at_start_with_what_to_write_instead(server, advice):
    result = subprocess.run([TWISTD, "-n", "--pidfile=", "infx-engine", "--server", server, "--models", "m"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("twistd infx-engine: --server takes the gateway's engine port as HOST:PORT, not a URL")
    assert advice in line
