"""Mutual TLS between gateway replicas: gateways in this process on distinct loopback
addresses with static peers, a CA and per-gateway certificates made by the test.

Engines and requests cross over mTLS; the internal port speaks TLS with ALPN h2 and
requires a client certificate; a peer with a certificate from another CA, or none,
is refused at the handshake, logged, and registers nothing while others keep being
served; a dialled peer whose server certificate is from another CA is not trusted;
only the chain is checked, not the name or address in the certificate; and the
options are validated once, with messages naming the option.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from pathlib import Path
from typing import Any, Callable

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from twisted.internet import defer, reactor, task, threads
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage

from infx.config import ConfigError, build_config
from infx.service import GatewayService
from infx.tap import Options
from protocol.processor_types import Locality

HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
HTTP = "tcp:0:interface=127.0.0.1"


def _loopback_aliases_work() -> bool:
    try:
        with socket.socket() as s:
            s.bind((HOSTS["c"], 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_aliases_work(), reason="127.0.0.x aliases are not bindable here")


# --- a small PKI -----------------------------------------------------------------


class Authority:
    """A self-signed CA that issues leaf certificates into a directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (self._builder(subject, self.key.public_key())
                     .issuer_name(subject)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                    critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_path = directory / f"{name}.pem"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def issue(self, name: str, ips: tuple[str, ...] = (), dns: tuple[str, ...] = ()) -> tuple[str, str]:
        """(cert path, key path) of a leaf usable as TLS server and client."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        names += [x509.DNSName(d) for d in dns]
        builder = (self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key())
                   .issuer_name(self.cert.subject)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                         x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = self.directory / f"{self.name}-{name}.crt"
        key_path = self.directory / f"{self.name}-{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("pki")
    internal = Authority(directory, "internal")
    rogue = Authority(directory, "rogue")
    return {
        "ca": str(internal.ca_path),
        "rogue_ca": str(rogue.ca_path),
        **{name: internal.issue(f"gw-{name}", ips=(host,)) for name, host in HOSTS.items()},
        "rogue": rogue.issue("gw-rogue", ips=tuple(HOSTS.values())),
        # Names neither the dialled address nor anything else a peer could check.
        "elsewhere": internal.issue("gw-elsewhere", ips=("10.9.9.9",), dns=("not-this-host.example",)),
    }


def tls(pki: dict[str, Any], name: str, ca: str = "ca") -> dict[str, str]:
    cert, key = pki[name]
    return {"internal_tls_cert": cert, "internal_tls_key": key, "internal_tls_ca": pki[ca]}


# --- gateways --------------------------------------------------------------------


@pytest.fixture
def gateways():
    started: list[GatewayService] = []

    @pytest_twisted.inlineCallbacks
    def start(name: str, host: str, **options: Any):
        config = build_config({}, {"http": HTTP, "worker_grpc": HTTP, "internal_grpc": f"tcp:0:interface={host}",
                                   "status_interval": 0.5, **options})
        gateway = GatewayService(reactor, config, pod_name=name)
        yield gateway.startService()
        started.append(gateway)
        return gateway

    yield start
    for gateway in reversed(started):
        if gateway.running:
            pytest_twisted.blockon(gateway.stopService())


@pytest.fixture
def logged():
    """Formatted log lines emitted during the test."""
    lines: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def internal_address(gateway: GatewayService) -> str:
    address = gateway.internal_grpc.port.getHost()
    return f"{address.host}:{address.port}"


def engines(gateway: GatewayService) -> dict[tuple[str, Locality], int]:
    return gateway.processor.engine_counts()


@defer.inlineCallbacks
def until(condition: Callable[[], Any], timeout: float = 10.0):
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() > deadline:
            raise AssertionError("condition not met in time")
        yield task.deferLater(reactor, 0.02, lambda: None)


def chat(gateway: GatewayService, model: str) -> str:
    import openai

    base = f"http://127.0.0.1:{gateway.http.port.getHost().port}/v1"
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=10)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "over mutual tls"}])
    return str(reply.choices[0].message.content)


def handshake(address: str, ca: str, client: tuple[str, str] | None) -> tuple[str | None, dict[str, Any]]:
    """A raw TLS client: (negotiated ALPN, server certificate); reads once so that a
    TLS 1.3 server's refusal of the client certificate surfaces here."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(*client)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw) as conn:
            alpn, cert = conn.selected_alpn_protocol(), conn.getpeercert()
            conn.settimeout(2)
            try:
                conn.recv(1)  # the server's HTTP/2 SETTINGS, or its alert
            except socket.timeout:
                pass
            return alpn, cert


# --- exchange over mTLS ----------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_engines_and_requests_cross_between_three_gateways_over_mutual_tls(gateways, pki):
    """Each internal port only accepts mTLS (see the refusal tests), so that b's engine shows
    up at a and serves a's request proves the exchange ran over it."""
    c = yield gateways("c", HOSTS["c"], **tls(pki, "c"))
    a = yield gateways("a", HOSTS["a"], peers=internal_address(c), **tls(pki, "a"))
    b = yield gateways("b", HOSTS["b"], echo_models="m", peers=internal_address(a), **tls(pki, "b"))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    assert (yield threads.deferToThread(chat, a, "m")) == "over mutual tls"
    # a reaches c too (a's receiver is a TLS client of c's internal server).
    yield until(lambda: [s.pod_name for s in c.exchanger.streams] == ["a"])
    assert b.exchanger.receivers[internal_address(a)].streams_opened == 1


@pytest_twisted.inlineCallbacks
def test_the_internal_port_speaks_tls_with_alpn_h2_and_requires_a_client_certificate(gateways, pki):
    a = yield gateways("a", HOSTS["a"], **tls(pki, "a"))
    alpn, cert = yield threads.deferToThread(handshake, internal_address(a), pki["ca"], pki["b"])
    assert alpn == "h2"
    assert dict(item[0] for item in cert["subject"])["commonName"] == "gw-a"
    with pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        yield threads.deferToThread(handshake, internal_address(a), pki["ca"], None)


# --- refusals --------------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_a_peer_with_a_certificate_from_another_ca_is_refused_logged_and_others_keep_being_served(
        gateways, pki, logged):
    a = yield gateways("a", HOSTS["a"], **tls(pki, "a"))
    # The rogue trusts our CA, so only a's check of its client certificate can stop it.
    rogue = yield gateways("rogue", HOSTS["b"], echo_models="m", peers=internal_address(a),
                           **tls(pki, "rogue", ca="ca"))
    receiver = rogue.exchanger.receivers[internal_address(a)]
    yield until(lambda: receiver.failures >= 2)
    assert receiver.streams_opened == 0
    assert engines(a) == {} and a.exchanger.streams == set()
    assert any("refused peer 127.0.0.1:" in line and "certificate verify failed" in line for line in logged)

    yield gateways("c", HOSTS["c"], echo_models="m", peers=internal_address(a), **tls(pki, "c"))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    assert (yield threads.deferToThread(chat, a, "m")) == "over mutual tls"
    assert [s.pod_name for s in a.exchanger.streams] == ["c"]


@pytest_twisted.inlineCallbacks
def test_a_peer_without_tls_is_refused_and_registers_no_engines(gateways, pki, logged):
    a = yield gateways("a", HOSTS["a"], **tls(pki, "a"))
    plain = yield gateways("plain", HOSTS["b"], echo_models="m", peers=internal_address(a))
    receiver = plain.exchanger.receivers[internal_address(a)]
    yield until(lambda: receiver.failures >= 2)
    assert receiver.streams_opened == 0 and engines(a) == {}
    assert any("refused peer" in line for line in logged)


@pytest_twisted.inlineCallbacks
def test_a_dialled_peer_whose_certificate_is_from_another_ca_is_not_trusted(gateways, pki):
    """The receiver checks the server too: a rogue internal server is sent nothing."""
    rogue = yield gateways("rogue", HOSTS["a"], **tls(pki, "rogue", ca="ca"))
    b = yield gateways("b", HOSTS["b"], echo_models="m", peers=internal_address(rogue), **tls(pki, "b"))
    receiver = b.exchanger.receivers[internal_address(rogue)]
    yield until(lambda: receiver.failures >= 2)
    assert receiver.streams_opened == 0
    assert engines(rogue) == {} and rogue.exchanger.streams == set()


@pytest_twisted.inlineCallbacks
def test_only_the_chain_is_checked_not_the_name_or_address_in_the_certificate(gateways, pki):
    """Pods are dialled at changing IPs, so a certificate naming another address is accepted
    in both directions as long as it chains to the internal CA."""
    a = yield gateways("a", HOSTS["a"], **tls(pki, "elsewhere"))
    yield gateways("b", HOSTS["b"], echo_models="m", peers=internal_address(a), **tls(pki, "elsewhere"))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})


# --- configuration ---------------------------------------------------------------


def test_the_three_tls_options_are_all_or_nothing(pki):
    cert, key = pki["a"]
    assert build_config({}, {}).internal_tls_cert is None
    with pytest.raises(ConfigError, match="needs --internal-tls-ca too"):
        build_config({}, {"internal_tls_cert": cert, "internal_tls_key": key})
    with pytest.raises(ConfigError, match="needs --internal-tls-cert, --internal-tls-key too"):
        build_config({}, {"internal_tls_ca": pki["ca"]})


def test_unreadable_or_unparseable_files_name_the_option(pki, tmp_path):
    cert, key = pki["a"]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a pem file\n")
    with pytest.raises(ConfigError, match="--internal-tls-ca: cannot read .*missing.pem"):
        build_config({}, {**tls(pki, "a"), "internal_tls_ca": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="--internal-tls-cert: .* holds no PEM certificate"):
        build_config({}, {**tls(pki, "a"), "internal_tls_cert": str(garbage)})
    with pytest.raises(ConfigError, match="--internal-tls-key: .* holds no unencrypted PEM private key"):
        build_config({}, {**tls(pki, "a"), "internal_tls_key": cert})
    with pytest.raises(ConfigError, match="--internal-tls-key: .* is not the private key of the certificate"):
        build_config({}, {**tls(pki, "a"), "internal_tls_key": pki["b"][1]})


def test_tls_options_want_a_plain_tcp_listen_endpoint(pki):
    with pytest.raises(ConfigError, match="--internal-grpc: give a tcp: endpoint"):
        build_config({}, {**tls(pki, "a"), "internal_grpc": "ssl:8083:privateKey=k.pem:certKey=c.pem"})


def test_tls_options_come_from_flags_or_yaml_and_errors_are_usage_errors(pki, tmp_path):
    cert, key = pki["a"]
    options = Options()
    options.parseOptions(["--internal-tls-cert", cert, "--internal-tls-key", key, "--internal-tls-ca", pki["ca"]])
    assert (options.config_value.internal_tls_cert, options.config_value.internal_tls_ca) == (cert, pki["ca"])
    config_file = tmp_path / "infx.yaml"
    config_file.write_text(f"internal_tls_cert: {cert}\ninternal_tls_key: {key}\ninternal_tls_ca: {pki['ca']}\n")
    options = Options()
    options.parseOptions(["--config", str(config_file)])
    assert options.config_value.internal_tls_key == key
    with pytest.raises(usage.UsageError, match="--internal-tls-key"):
        Options().parseOptions(["--internal-tls-cert", cert, "--internal-tls-ca", pki["ca"]])
