"""infx's gRPC stack interoperates with grpcio on every standard interop case and infx's extras.

Both directions, each case parametrized: grpcio's client (tests/support/interop_grpcio.py)
against ``tools/interop_server.py`` run as a subprocess, and
``tools/interop_client.py`` run as a subprocess against grpcio's TestService.
Two more sets tell failures apart: grpcio against grpcio (a bug in the
reference half) and infx against infx. A few cases run again over TLS with
the test credentials of ``tools/interop_testdata/``, both ways. Servers
start once per module.
Hypothesis then picks message sizes around HTTP/2's frame and window edges
for both directions, and two machine-level tests pin, without sockets, the
interop failures found here.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.grpc import CallEnded, GrpcConfig, GrpcConnection, StatusCode
from protocol.pb.grpc_testing import messages_pb2
from tests.support.interop_grpcio import CASES, GRPCIO_CASES, MiB, SERVICE, GrpcioInteropServer, GrpcioTestService, run_case
from tests.support.interop_infx_duplex import duplex_request
from tests.support.interop_sniffer import CompressionSniffer

#: Both peers run as child processes (tools/interop_server.py, tools/interop_client.py).
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TESTDATA = ROOT / "tools" / "interop_testdata"
SERVER_START_TIMEOUT = 20.0
CLIENT_TIMEOUT = 30.0
#: The name grpc's interop tests give ``--server_host_override``; the test certificate covers it.
TLS_NAME = "foo.test.google.fr"
PLAINTEXT = ("--use_tls=false",)
TEST_CA_TLS = ("--use_tls=true", "--use_test_ca=true", f"--server_host_override={TLS_NAME}")
TLS_CASES = ["empty_unary", "large_unary", "ping_pong", "custom_metadata", "half_duplex"]


class InfxServer:
    """``tools/interop_server.py --port=0 FLAGS`` in a subprocess; stderr goes to ``log`` for failure reports."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.log = log
        self._process = subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "interop_server.py"), "--port=0", *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )
        self.port = self._read_port()

    def _read_port(self) -> int:
        lines: list[str] = []
        stdout = self._process.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(SERVER_START_TIMEOUT)
        if not lines or not lines[0].startswith("listening on port "):
            self.stop()
            pytest.fail(f"interop_server did not start: {lines!r}\n{self.log_tail()}")
        return int(lines[0].rsplit(" ", 1)[1])

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@pytest.fixture(scope="module")
def infx_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfxServer]:
    server = InfxServer(tmp_path_factory.mktemp("interop") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def infx_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfxServer]:
    server = InfxServer(tmp_path_factory.mktemp("interop_tls") / "server.log", "--use_tls=true")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def grpcio_server() -> Iterator[GrpcioInteropServer]:
    server = GrpcioInteropServer()
    yield server
    server.stop()


class GrpcioTlsServer:
    """grpcio's TestService over TLS with the test server certificate.

    No CompressionSniffer reads through TLS, so the compression cases stay on the plaintext servers.
    """

    def __init__(self) -> None:
        service = GrpcioTestService(_no_sniffer)
        credentials = grpc.ssl_server_credentials([((TESTDATA / "server.key").read_bytes(),
                                                    (TESTDATA / "server.pem").read_bytes())])
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers([service.handler()])
        self.port = self._server.add_secure_port("127.0.0.1:0", credentials)
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)


def _no_sniffer() -> CompressionSniffer:
    raise AssertionError("a compression case ran against the TLS server")


@pytest.fixture(scope="module")
def grpcio_tls_server() -> Iterator[GrpcioTlsServer]:
    server = GrpcioTlsServer()
    yield server
    server.stop()


def run_infx_client(port: int, case: str, flags: Sequence[str] = PLAINTEXT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "interop_client.py"), "--server_host=127.0.0.1",
         f"--server_port={port}", f"--test_case={case}", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT,
    )


def grpcio_tls_channel(port: int) -> grpc.Channel:
    """A grpcio channel trusting the test CA and verifying the server as ``TLS_NAME``, as grpc's interop client does."""
    credentials = grpc.ssl_channel_credentials(root_certificates=(TESTDATA / "ca.pem").read_bytes())
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", TLS_NAME)])


@pytest.mark.parametrize("case", CASES)
def test_grpcio_client_passes_against_infx_server(case: str, infx_server: InfxServer) -> None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{infx_server.port}") as channel:
            GRPCIO_CASES[case](channel)
    except Exception as error:
        pytest.fail(f"{case}: {error}\n--- interop_server stderr ---\n{infx_server.log_tail()}")


@pytest.mark.parametrize("case", CASES)
def test_infx_client_passes_against_grpcio_server(case: str, grpcio_server: GrpcioInteropServer) -> None:
    result = run_infx_client(grpcio_server.port, case)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"PASS {case}" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_infx_client_passes_against_infx_server(case: str, infx_server: InfxServer) -> None:
    result = run_infx_client(infx_server.port, case)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n--- interop_server stderr ---\n{infx_server.log_tail()}"
    assert f"PASS {case}" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_reference_grpcio_halves_agree(case: str, grpcio_server: GrpcioInteropServer) -> None:
    """The grpcio client and server used as references pass every case against each other."""
    run_case(case, grpcio_server.port)


@pytest.mark.parametrize("case", TLS_CASES)
def test_grpcio_tls_client_passes_against_infx_tls_server(case: str, infx_tls_server: InfxServer) -> None:
    try:
        with grpcio_tls_channel(infx_tls_server.port) as channel:
            GRPCIO_CASES[case](channel)
    except Exception as error:
        pytest.fail(f"{case}: {error}\n--- interop_server stderr ---\n{infx_tls_server.log_tail()}")


@pytest.mark.parametrize("case", TLS_CASES)
def test_infx_tls_client_passes_against_grpcio_tls_server(case: str, grpcio_tls_server: GrpcioTlsServer) -> None:
    result = run_infx_client(grpcio_tls_server.port, case, TEST_CA_TLS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"PASS {case}" in result.stdout


@pytest.mark.parametrize(("flags", "reason"), [
    (("--use_tls=true", f"--server_host_override={TLS_NAME}"), "certificate verify failed"),
    (("--use_tls=true", "--use_test_ca=true", "--server_host_override=wrong.example.com"), "DNSMismatch"),
], ids=["system-roots", "wrong-name"])
def test_infx_tls_client_fails_when_it_cannot_verify_the_server(
    flags: tuple[str, ...], reason: str, grpcio_tls_server: GrpcioTlsServer,
) -> None:
    """The system's roots do not know the test CA; and with it, the override must still name the certificate."""
    result = run_infx_client(grpcio_tls_server.port, "empty_unary", flags)
    assert result.returncode != 0
    assert "FAIL empty_unary: unexpected status UNAVAILABLE" in result.stderr
    assert reason in result.stderr


def test_infx_server_and_client_take_other_credentials_from_flags(tmp_path: Path) -> None:
    """Credentials fresh from make_certs.py, in a directory with a colon (endpoint-string quoting): the server serves
    them given ``--tls_cert_file``/``--tls_key_file`` and the client trusts them given ``--ca_file``, while the
    bundled test CA does not verify that server (so the flags were not ignored)."""
    certs = tmp_path / "fresh:certs"
    subprocess.run([sys.executable, str(TESTDATA / "make_certs.py"), str(certs)],
                   check=True, timeout=CLIENT_TIMEOUT)
    server = InfxServer(tmp_path / "server.log", "--use_tls=true",
                        f"--tls_cert_file={certs / 'server.pem'}", f"--tls_key_file={certs / 'server.key'}")
    try:
        fresh = run_infx_client(server.port, "empty_unary",
                                ("--use_tls=true", f"--ca_file={certs / 'ca.pem'}", f"--server_host_override={TLS_NAME}"))
        bundled = run_infx_client(server.port, "empty_unary", TEST_CA_TLS)
    finally:
        server.stop()
    assert fresh.returncode == 0, f"{fresh.stdout}{fresh.stderr}\n--- interop_server stderr ---\n{server.log_tail()}"
    assert bundled.returncode != 0
    assert "certificate verify failed" in bundled.stderr


def test_infx_server_streams_responses_paced_by_interval_us(infx_server: InfxServer) -> None:
    """``interval_us`` delays each response on the server's clock; every response still arrives, in order."""
    request = messages_pb2.StreamingOutputCallRequest(response_parameters=[
        messages_pb2.ResponseParameters(size=size, interval_us=2000) for size in (3, 1, 2)
    ])
    with grpc.insecure_channel(f"127.0.0.1:{infx_server.port}") as channel:
        call = channel.unary_stream(f"/{SERVICE}/StreamingOutputCall")
        sizes = [len(messages_pb2.StreamingOutputCallResponse.FromString(r).payload.body)
                 for r in call(request.SerializeToString())]
    assert sizes == [3, 1, 2]


def test_infx_client_exits_nonzero_with_a_reason_when_a_case_fails() -> None:
    """Nothing listens on the port, so empty_unary cannot succeed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_infx_client(port, "empty_unary")
    assert result.returncode != 0
    assert "FAIL empty_unary: unexpected status UNAVAILABLE" in result.stderr


# Sizes around the edges that framing code gets wrong: HTTP/2's default frame
# (16 KiB) and window (64 KiB), and the 5-byte gRPC prefix straddling them.
EDGES = [0, 1, 16_379, 16_384, 16_389, 65_530, 65_535, 65_540, MiB - 5, MiB, 2 * MiB + 7]
SIZE = st.one_of(st.sampled_from(EDGES), st.integers(0, 70_000), st.integers(0, 3 * MiB))
EXCHANGES = st.lists(st.tuples(SIZE, SIZE), min_size=1, max_size=4)
SIZE_SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@SIZE_SETTINGS
@given(exchanges=EXCHANGES)
def test_grpcio_client_and_infx_server_carry_messages_of_any_size(
    infx_server: InfxServer, exchanges: list[tuple[int, int]],
) -> None:
    """FullDuplexCall with Hypothesis-chosen request and response sizes, all requests sent at once."""
    with grpc.insecure_channel(f"127.0.0.1:{infx_server.port}") as channel:
        call = channel.stream_stream(f"/{SERVICE}/FullDuplexCall")
        requests = [duplex_request(*pair).SerializeToString() for pair in exchanges]
        sizes = [len(messages_pb2.StreamingOutputCallResponse.FromString(r).payload.body) for r in call(iter(requests))]
    assert sizes == [response for _, response in exchanges]


@settings(SIZE_SETTINGS, max_examples=8)  # a subprocess per example
@given(exchanges=EXCHANGES)
def test_infx_client_and_grpcio_server_carry_messages_of_any_size(
    grpcio_server: GrpcioInteropServer, exchanges: list[tuple[int, int]],
) -> None:
    """The same exchange from infx's client (in a subprocess) against grpcio's TestService."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.interop_infx_duplex", str(grpcio_server.port), json.dumps(exchanges)],
        cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [response for _, response in exchanges]


def connected_pair() -> tuple[GrpcConnection, GrpcConnection]:
    client = GrpcConnection(GrpcConfig(client_side=True))
    server = GrpcConnection(GrpcConfig(client_side=False))
    client.initiate(0.0)
    server.initiate(0.0)
    return client, server


def test_client_machine_survives_a_rejection_arriving_with_the_server_settings() -> None:
    """Minimal form of large_request_rejected on infx's client.

    The client sends a 5 MiB request before the server's SETTINGS arrive; the
    server answers, in one read, with its SETTINGS and a trailers-only
    RESOURCE_EXHAUSTED that closes the stream. The client ends the call with
    that status instead of flushing the queued request onto the closed stream
    (which once raised h2's StreamClosedError out of receive_data).
    """
    client, server = connected_pair()
    stream_id = client.start_call(f"/{SERVICE}/UnaryCall", now=0.0)
    client.send_message(stream_id, bytes(5 << 20))
    client.end_stream(stream_id)
    ended: list[CallEnded] = []
    for _ in range(100):
        request_bytes = client.data_to_send()
        server.receive_data(request_bytes, 0.0)
        response_bytes = server.data_to_send()
        if not request_bytes and not response_bytes:
            break
        ended += [e for e in client.receive_data(response_bytes, 0.0) if isinstance(e, CallEnded)]
    assert [(e.stream_id, e.status) for e in ended] == [(stream_id, StatusCode.RESOURCE_EXHAUSTED)]


def test_server_machine_ends_an_expired_call_with_a_deadline_exceeded_status() -> None:
    """An expired deadline on the server ends the call with a DEADLINE_EXCEEDED status, as grpcio's server does.

    grpcio's server answers with a trailers-only ``grpc-status: 4`` then
    RST_STREAM(NO_ERROR). A bare RST_STREAM(CANCEL) would make a client whose
    own timer has not fired yet end the call CANCELLED (timeout_on_sleeping_server
    was flaky for grpcio's client against infx's server for that reason).
    """
    client, server = connected_pair()
    stream_id = client.start_call(f"/{SERVICE}/FullDuplexCall", timeout=1.0, now=0.0)
    server.receive_data(client.data_to_send(), 0.0)
    client.receive_data(server.data_to_send(), 0.0)
    server.handle_timeout(1.5)
    events = client.receive_data(server.data_to_send(), 0.9)
    ended = [(e.stream_id, e.status) for e in events if isinstance(e, CallEnded)]
    assert ended == [(stream_id, StatusCode.DEADLINE_EXCEEDED)]
