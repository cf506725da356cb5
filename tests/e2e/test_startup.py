"""Start-up is all or nothing: every port listens before anything starts, or the gateway does not run.

The service tree is driven on a memory reactor whose listens can be made to
fail; the command line's one-line errors and exit codes are pinned on real
``twistd`` processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.error import CannotListenError
from twisted.internet.testing import MemoryReactorClock

from infx import __version__
from infx.cli import EXIT_CANNOT_LISTEN, EXIT_USAGE, ExitIfCannotListen
from infx.config import build_config
from infx.service import GatewayService, ListenFailed

ROOT = Path(__file__).resolve().parents[2]
TWISTD = str(Path(sys.executable).with_name("twistd"))


class _Port:
    """A listening port that records whether it was closed."""

    host = "127.0.0.1"

    def __init__(self, port: int) -> None:
        self.port = port
        self.closed = False

    def stopListening(self) -> None:
        self.closed = True

    def getHost(self):
        return self


class ListenReactor(MemoryReactorClock):
    """A memory reactor on which listening on ``refused`` ports fails as a taken port does."""

    def __init__(self, refused: dict[int, int]) -> None:
        super().__init__()
        self.refused = refused
        self.ports: dict[int, _Port] = {}

    def listenTCP(self, port, factory, backlog=50, interface=""):
        if port in self.refused:
            raise CannotListenError(interface, port, OSError(self.refused[port], "refused"))
        self.ports[port] = _Port(port)
        return self.ports[port]


def gateway_on(reactor, **options) -> GatewayService:
    config = build_config({}, {"http": "tcp:18080", "worker_grpc": "tcp:18082", "internal_grpc": "tcp:18083",
                               **options})
    return GatewayService(reactor, config, environ={})


def test_nothing_starts_until_every_port_listens_and_ports_bind_before_privileges_drop():
    reactor = ListenReactor({})
    gateway = gateway_on(reactor, echo_models="echo")
    listening = gateway.when_listening()
    gateway.privilegedStartService()
    # twistd -u/-g drops root here: every port is already bound, nothing else has started.
    assert sorted(reactor.ports) == [18080, 18082, 18083]
    assert listening.called
    assert not gateway.gateway.ready and not gateway.builtin_engine.running
    gateway.startService()
    assert gateway.gateway.ready and gateway.builtin_engine.running
    assert sorted(reactor.ports) == [18080, 18082, 18083]  # startService did not bind a second time


def test_a_port_that_cannot_be_bound_closes_the_others_and_nothing_starts():
    import errno

    reactor = ListenReactor({18082: errno.EADDRINUSE})
    gateway = gateway_on(reactor, echo_models="echo")
    failures = []
    gateway.when_listening().addErrback(failures.append)
    gateway.startService()
    assert isinstance(gateway.listen_failure, ListenFailed)
    assert str(gateway.listen_failure) == "--worker-grpc: cannot listen on tcp:18082: port 18082 is already in use"
    assert failures and failures[0].check(ListenFailed)
    assert reactor.ports[18080].closed
    assert 18083 not in reactor.ports  # bound after the failure: never
    assert not gateway.gateway.ready and not gateway.builtin_engine.running
    late = []
    gateway.when_listening().addErrback(late.append)
    assert late and late[0].check(ListenFailed)
    stopped = gateway.stopService()  # an embedding application shutting down after the failure
    reactor.advance(1)
    assert stopped.called and not gateway.running


def test_a_privileged_port_without_root_says_how_to_get_it():
    import errno

    gateway = gateway_on(ListenReactor({80: errno.EACCES}), http="80")
    gateway.startService()
    assert str(gateway.listen_failure).startswith("--http: cannot listen on tcp:80: permission denied for port 80")
    assert "-u/-g" in str(gateway.listen_failure)


def test_twistd_exits_before_the_reactor_runs_when_a_port_cannot_be_bound():
    import errno

    reactor = ListenReactor({18083: errno.EADDRINUSE})
    top = ExitIfCannotListen(reactor, gateway_on(reactor), exit=pytest.fail)
    with pytest.raises(SystemExit) as exited:
        top.privilegedStartService()
    assert exited.value.code == EXIT_CANNOT_LISTEN


class _LateBindingGateway(Service):
    """A gateway whose endpoint binds after the reactor started (as a plugin endpoint may)."""

    listen_failure = None

    def __init__(self) -> None:
        self.outcome: defer.Deferred[None] = defer.Deferred()

    def when_listening(self) -> defer.Deferred[None]:
        return self.outcome


class _RunningReactor:
    """What :class:`ExitIfCannotListen` asks of a running reactor: stop it, run things after."""

    def __init__(self) -> None:
        self.stopped = False
        self.after_shutdown: list = []

    def stop(self) -> None:
        self.stopped = True

    def addSystemEventTrigger(self, phase, event, callable, *args):
        assert (phase, event) == ("after", "shutdown")
        self.after_shutdown.append(lambda: callable(*args))


def test_a_port_that_fails_after_the_reactor_started_stops_it_with_the_exit_code():
    reactor = _RunningReactor()
    exits: list[int] = []
    gateway = _LateBindingGateway()
    top = ExitIfCannotListen(reactor, gateway, exit=exits.append)
    top.privilegedStartService()
    top.startService()
    gateway.outcome.errback(ListenFailed("--http: cannot listen on tor:...: no route"))
    assert reactor.stopped and exits == []
    for trigger in reactor.after_shutdown:
        trigger()
    assert exits == [EXIT_CANNOT_LISTEN]


# --- real twistd processes ----------------------------------------------------------------------


def twistd(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TWISTD, "-n", "--pidfile=", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"})


def loopback(port: int = 0) -> str:
    return f"tcp:{port}:interface=127.0.0.1"


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_twistd_infx_with_a_taken_port_exits_1_with_one_line_naming_the_option_and_port(taken_port):
    result = twistd("infx", "--http", loopback(), "--worker-grpc", loopback(taken_port),
                    "--internal-grpc", loopback(), "--echo-models", "echo")
    assert result.returncode == EXIT_CANNOT_LISTEN, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if "#critical]" in line or "Traceback" in line]
    assert len(errors) == 1, result.stdout
    assert errors[0].endswith(f"--worker-grpc: cannot listen on {loopback(taken_port)}: "
                              f"port {taken_port} is already in use")
    assert "Unhandled error" not in result.stdout and "builtin-echo" not in result.stdout


@pytest.mark.parametrize("option,value,message", [
    ("--http", "tcp:99999", "--http: port 99999 is out of range"),
    ("--worker-grpc", "tcp:notaport", "--worker-grpc: 'tcp:notaport' is not a server endpoint"),
    ("--internal-grpc", "foo:bar", "--internal-grpc: 'foo:bar' is not a server endpoint (Unknown endpoint type"),
    ("--http", "127.0.0.1:28080", "did you mean tcp:28080:interface=127.0.0.1?"),
])
def test_twistd_infx_refuses_endpoints_that_cannot_listen_with_one_line_and_exit_2(option, value, message):
    result = twistd("infx", option, value)
    assert result.returncode == EXIT_USAGE
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("twistd infx: ") and message in line


def test_configuration_errors_are_one_line_and_exit_2(tmp_path):
    bad_yaml = tmp_path / "infx.yaml"
    bad_yaml.write_text("http: [8080\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-1, admin: 'false'}\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("kind: Config\n")
    cases = [
        (["--config", str(bad_yaml)], f"--config: {bad_yaml} is not valid YAML"),
        (["--config", str(tmp_path / "missing.yaml")], "--config: cannot read"),
        (["--api-keys", str(tmp_path / "missing.yaml")], "cannot read API key file"),
        (["--api-keys", str(keys)], "'admin' must be true or false"),
        (["--internal-tls-cert", str(keys), "--internal-tls-key", str(keys), "--internal-tls-ca", str(keys)],
         "--internal-tls-cert: "),
        (["--kube", "--queue-timeout", "soon"], "--queue-timeout: invalid value 'soon'"),
    ]
    for args, message in cases:
        result = twistd("infx", "--http", loopback(), "--worker-grpc", loopback(), "--internal-grpc", loopback(), *args)
        assert result.returncode == EXIT_USAGE, (args, result.stdout, result.stderr)
        (line,) = result.stderr.splitlines()
        assert message in line, (args, line)


def test_kube_without_a_cluster_config_is_one_line_and_exit_2(tmp_path):
    result = twistd("infx", "--kube", "--http", loopback(), "--worker-grpc", loopback(),
                    "--internal-grpc", loopback(), "--peer-port", "8083")
    assert result.returncode == EXIT_USAGE
    (line,) = result.stderr.splitlines()
    assert line.startswith("twistd infx: --kube: no usable Kubernetes client config from ~/.kube/config")


@pytest.mark.parametrize("command", ["infx", "infx-engine"])
def test_version_prints_infx_version(command):
    result = twistd(command, "--version")
    assert (result.returncode, result.stdout) == (0, f"infx {__version__}\n")


def test_engine_usage_errors_are_one_line_too():
    result = twistd("infx-engine", "--server", "nohost", "--models", "m")
    assert result.returncode == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "twistd infx-engine: --server must be HOST:PORT, got 'nohost' (twistd infx-engine --help lists the options)"]


def test_tools_run_starts_from_a_complete_venv_without_pip_or_network():
    """With no package index reachable, pip would fail: ``tools/run`` must not need it."""
    import os

    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/"}
    result = subprocess.run([str(ROOT / "tools" / "run"), "--version"], capture_output=True, text=True, timeout=60,
                            env=env, cwd="/")
    assert (result.returncode, result.stdout) == (0, f"infx {__version__}\n"), result.stderr
    assert "pip" not in result.stderr and "tools/run:" not in result.stderr


def _free_privileged_ports(count: int) -> list[int]:
    ports = []
    for port in range(1023, 900, -1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    pytest.skip("no free port below 1024")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="binding below 1024 needs root")
def test_twistd_u_g_binds_ports_below_1024_then_serves_as_the_unprivileged_user(tmp_path):
    from harness.twistd_processes import TwistdChild, http_get, wait_until

    http, worker, internal = _free_privileged_ports(3)
    child = TwistdChild("privileged", ["-u", "65534", "-g", "65534", "infx", "--http", loopback(http),
                                       "--worker-grpc", loopback(worker), "--internal-grpc", loopback(internal),
                                       "--echo-models", "echo", "--workers", "1"], tmp_path)
    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{http}/readyz")[0] == 200, "/readyz", [child])
        assert "set uid/gid 65534/65534" in child.output()
        with open(f"/proc/{child.process.pid}/status") as status:
            uids = next(line for line in status if line.startswith("Uid:")).split()[1:]
        assert set(uids) == {"65534"}
    finally:
        child.stop()


def test_a_daemonized_twistd_with_a_taken_port_tells_its_parent_which_exits_1(taken_port, tmp_path):
    """Without -n the parent waits on twistd's status pipe: it must hear the error, not hang."""
    result = subprocess.run(
        [TWISTD, f"--pidfile={tmp_path / 'infx.pid'}", "--logfile", str(tmp_path / "infx.log"), "infx",
         "--http", loopback(), "--worker-grpc", loopback(taken_port), "--internal-grpc", loopback()],
        capture_output=True, text=True, timeout=30, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1
    assert "ListenFailed: --worker-grpc: cannot listen on" in result.stderr
    assert f"port {taken_port} is already in use" in (tmp_path / "infx.log").read_text()
    # twistd's daemon removes its pidfile just after it wrote to the status pipe, so the parent
    # may have exited (and subprocess.run returned) first: wait for the daemon, generously.
    pidfile = tmp_path / "infx.pid"
    deadline = time.monotonic() + 30
    while pidfile.exists():
        assert time.monotonic() < deadline, f"the daemon left its pidfile {pidfile}"
        time.sleep(0.05)
