"""Mutual TLS between gateway replicas: gateways in this process on distinct loopback
addresses with static peers, a CA and per-gateway certificates made by the test.

Engines and requests cross over mTLS; the internal port speaks TLS with ALPN h2 and
requires a client certificate; a peer with a certificate from another CA, or none,
is refused at the handshake, logged, and registers nothing while others keep being
served; a dialled peer whose server certificate is from another CA is not trusted;
only the chain is checked, not the name or address in the certificate; the
options are validated at start, with messages naming the option; and files
rotated on disk (certificate, key, CA) serve new connections after the next
check while open connections keep theirs, and a half-rotated set is not loaded.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
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
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import IHandshakeListener, IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from zope.interface import implementer

from infx.config import ConfigError, build_config
from infx.exchange import peer_tls
from infx.exchange.peer_tls import CHECK_INTERVAL, PeerCredentials, PeerTLS
from infx.service import GatewayService
from infx.tap import GatewayOptions
from protocol.processor.keys import Locality

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
    options = GatewayOptions()
    options.parseOptions(["--internal-tls-cert", cert, "--internal-tls-key", key, "--internal-tls-ca", pki["ca"]])
    assert (options.config_value.internal_tls_cert, options.config_value.internal_tls_ca) == (cert, pki["ca"])
    config_file = tmp_path / "infx.yaml"
    config_file.write_text(f"internal_tls_cert: {cert}\ninternal_tls_key: {key}\ninternal_tls_ca: {pki['ca']}\n")
    options = GatewayOptions()
    options.parseOptions(["--config", str(config_file)])
    assert options.config_value.internal_tls_key == key
    with pytest.raises(usage.UsageError, match="--internal-tls-key"):
        GatewayOptions().parseOptions(["--internal-tls-cert", cert, "--internal-tls-ca", pki["ca"]])


# --- rotation on disk ------------------------------------------------------------


class Secret:
    """Files laid out like a mounted Kubernetes Secret: ``tls.crt``, ``tls.key`` and ``ca.crt``
    link through ``..data`` to a versioned directory, and an update swaps ``..data`` atomically."""

    NAMES = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}

    def __init__(self, directory: Path, cert: str, key: str, ca: str) -> None:
        self.directory = directory
        self.versions = 0
        directory.mkdir()
        self.update(cert=cert, key=key, ca=ca)
        for name in self.NAMES.values():
            (directory / name).symlink_to(f"..data/{name}")

    @property
    def files(self) -> tuple[str, str, str]:
        cert, key, ca = (str(self.directory / name) for name in self.NAMES.values())
        return cert, key, ca

    def update(self, **sources: str) -> None:
        """Copies in the ``cert``, ``key`` and ``ca`` given; the others stay as they were."""
        self.versions += 1
        version = self.directory / f"..v{self.versions}"
        if self.versions > 1:
            shutil.copytree(self.directory / "..data", version)
        else:
            version.mkdir()
        for what, source in sources.items():
            shutil.copyfile(source, version / self.NAMES[what])
        (self.directory / "..data_tmp").symlink_to(version.name)
        os.replace(self.directory / "..data_tmp", self.directory / "..data")


def serial(cert: str) -> int:
    return x509.load_pem_x509_certificate(Path(cert).read_bytes()).serial_number


def bundle(directory: Path, *authorities: Authority) -> str:
    path = directory / "bundle.pem"
    path.write_bytes(b"".join(a.ca_path.read_bytes() for a in authorities))
    return str(path)


@implementer(IHandshakeListener)
class Client(Protocol):
    """A dialling peer: the serial of the server's certificate, what the server echoed, whether it closed."""

    serial: int | None = None
    received = b""
    closed = False

    def handshakeCompleted(self) -> None:
        self.serial = self.transport.getPeerCertificate().to_cryptography().serial_number

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:
        self.closed = True


@implementer(IHandshakeListener)
class Echo(Protocol):
    """The internal server's stand-in: records the client certificate's serial and echoes."""

    factory: EchoFactory

    def handshakeCompleted(self) -> None:
        self.factory.clients.append(self.transport.getPeerCertificate().to_cryptography().serial_number)

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data)


class EchoFactory(Factory):
    protocol = Echo

    def __init__(self) -> None:
        self.clients: list[int] = []


class Loopback:
    """Internal TLS servers and peers dialling them on 127.0.0.1, closed after the test."""

    def __init__(self) -> None:
        self.ports: list[IListeningPort] = []
        self.clients: list[Client] = []

    def serve(self, tls: PeerTLS) -> tuple[IListeningPort, list[int]]:
        """A listening port and the serials of the client certificates it accepted."""
        factory = EchoFactory()
        port = reactor.listenTCP(0, tls.server_factory(reactor, factory), interface="127.0.0.1")
        self.ports.append(port)
        return port, factory.clients

    @defer.inlineCallbacks
    def connect(self, tls: PeerTLS, port: IListeningPort):
        endpoint = tls.client_endpoint(reactor, TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port))
        client = yield endpoint.connect(Factory.forProtocol(Client))
        self.clients.append(client)
        yield until(lambda: client.serial is not None or client.closed)
        return client

    def close(self) -> defer.Deferred[Any]:
        for client in self.clients:
            if not client.closed:
                client.transport.abortConnection()
        return defer.gatherResults([port.stopListening() for port in self.ports])


@pytest.fixture
def loopback():
    sockets = Loopback()
    yield sockets
    pytest_twisted.blockon(sockets.close())


@defer.inlineCallbacks
def echoes(client: Client, data: bytes = b"ping"):
    """Whether the server echoes ``data``; False when it closes the connection instead
    (with TLS 1.3 the client's handshake ends before the server has checked its certificate)."""
    client.received = b""
    client.transport.write(data)
    yield until(lambda: client.received == data or client.closed)
    return client.received == data


def credentials(cert: tuple[str, str], ca: str) -> PeerCredentials:
    return PeerCredentials.from_files(*cert, ca)


@pytest_twisted.inlineCallbacks
def test_new_connections_get_the_rotated_certificate_while_open_ones_keep_working(tmp_path, loopback, logged):
    ca = Authority(tmp_path, "ca1")
    old, new = ca.issue("gw-old"), ca.issue("gw-new")
    secret = Secret(tmp_path / "secret", *old, str(ca.ca_path))
    clock = task.Clock()
    port, _ = loopback.serve(PeerTLS(clock, PeerCredentials.from_files(*secret.files)))
    peer = PeerTLS(task.Clock(), credentials(ca.issue("gw-peer"), str(ca.ca_path)))
    before = yield loopback.connect(peer, port)
    assert before.serial == serial(old[0])

    secret.update(cert=new[0], key=new[1])
    clock.advance(CHECK_INTERVAL)
    after = yield loopback.connect(peer, port)
    assert after.serial == serial(new[0])
    assert (yield echoes(before)) and (yield echoes(after))
    assert any("internal TLS: loaded CN=gw-new (serial " in line and f"{serial(new[0]):x}" in line
               for line in logged)


@pytest_twisted.inlineCallbacks
def test_a_dialling_gateway_presents_its_rotated_certificate_on_its_next_connection(tmp_path, loopback):
    """Peers are dialled through the same :class:`PeerTLS`, so the client side rotates too."""
    ca = Authority(tmp_path, "ca1")
    old, new = ca.issue("gw-old"), ca.issue("gw-new")
    secret = Secret(tmp_path / "secret", *old, str(ca.ca_path))
    clock = task.Clock()
    peer = PeerTLS(clock, PeerCredentials.from_files(*secret.files))
    port, accepted = loopback.serve(PeerTLS(task.Clock(), credentials(ca.issue("gw-server"), str(ca.ca_path))))
    assert (yield echoes((yield loopback.connect(peer, port))))
    secret.update(cert=new[0], key=new[1])
    clock.advance(CHECK_INTERVAL)
    assert (yield echoes((yield loopback.connect(peer, port))))
    assert accepted == [serial(old[0]), serial(new[0])]


@pytest_twisted.inlineCallbacks
def test_a_rotated_ca_bundle_admits_peers_of_the_new_ca_and_still_those_of_the_old(tmp_path, loopback, logged):
    ca1, ca2 = Authority(tmp_path, "ca1"), Authority(tmp_path, "ca2")
    both = bundle(tmp_path, ca1, ca2)
    secret = Secret(tmp_path / "secret", *ca1.issue("gw-a"), str(ca1.ca_path))
    clock = task.Clock()
    port, _ = loopback.serve(PeerTLS(clock, PeerCredentials.from_files(*secret.files)))
    # Both trust either CA, so only the server's check of their certificate can refuse them.
    newcomer = PeerTLS(task.Clock(), credentials(ca2.issue("gw-new"), both))
    veteran = PeerTLS(task.Clock(), credentials(ca1.issue("gw-old"), both))
    assert not (yield echoes((yield loopback.connect(newcomer, port))))
    assert any("refused peer" in line and "certificate verify failed" in line for line in logged)

    cert, key = ca2.issue("gw-a")
    secret.update(cert=cert, key=key, ca=both)
    clock.advance(CHECK_INTERVAL)
    assert (yield echoes((yield loopback.connect(newcomer, port))))
    assert (yield echoes((yield loopback.connect(veteran, port))))


@pytest_twisted.inlineCallbacks
def test_half_rotated_files_keep_the_current_credentials_until_the_key_follows(tmp_path, loopback, logged):
    """A new certificate beside the old key is refused once, with one warning, then retried."""
    ca = Authority(tmp_path, "ca1")
    old, new = ca.issue("gw-old"), ca.issue("gw-new")
    secret = Secret(tmp_path / "secret", *old, str(ca.ca_path))
    clock = task.Clock()
    port, _ = loopback.serve(PeerTLS(clock, PeerCredentials.from_files(*secret.files)))
    peer = PeerTLS(task.Clock(), credentials(ca.issue("gw-peer"), str(ca.ca_path)))

    secret.update(cert=new[0])
    for _ in range(2):
        clock.advance(CHECK_INTERVAL)
        client = yield loopback.connect(peer, port)
        assert client.serial == serial(old[0]) and (yield echoes(client))
    warnings = [line for line in logged if "keeping the current certificate" in line]
    assert len(warnings) == 1 and "is not the private key of the certificate" in warnings[0]

    secret.update(key=new[1])
    clock.advance(CHECK_INTERVAL)
    client = yield loopback.connect(peer, port)
    assert client.serial == serial(new[0]) and (yield echoes(client))


@pytest_twisted.inlineCallbacks
def test_the_files_are_read_at_most_once_per_check_interval(tmp_path, loopback, monkeypatch):
    ca = Authority(tmp_path, "ca1")
    old, new = ca.issue("gw-old"), ca.issue("gw-new")
    secret = Secret(tmp_path / "secret", *old, str(ca.ca_path))
    clock = task.Clock()
    port, _ = loopback.serve(PeerTLS(clock, PeerCredentials.from_files(*secret.files)))
    peer = PeerTLS(task.Clock(), credentials(ca.issue("gw-peer"), str(ca.ca_path)))
    reads: list[str] = []
    read = peer_tls._read
    monkeypatch.setattr(peer_tls, "_read", lambda path, option: reads.append(path) or read(path, option))

    secret.update(cert=new[0], key=new[1])
    for step in (1, 14, 14.5):
        clock.advance(step)
        assert (yield loopback.connect(peer, port)).serial == serial(old[0])
    assert reads == [] and clock.seconds() == CHECK_INTERVAL - 0.5
    clock.advance(0.5)
    for _ in range(3):
        assert (yield loopback.connect(peer, port)).serial == serial(new[0])
    assert sorted(reads) == sorted(secret.files)
