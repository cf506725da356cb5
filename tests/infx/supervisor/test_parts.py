"""The supervisor's parts in one process: a worker's role on the wire, the shared sockets, the peer
source with siblings, and every worker's metrics in one exposition."""

from __future__ import annotations

import socket

import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer, reactor
from twisted.internet.protocol import Factory, Protocol

from infx.config import ConfigError, build_config
from infx.service import ListenFailed
from infx.supervisor.metrics import labelled, render
from infx.supervisor.peers import SiblingPeerSource
from infx.supervisor.role import WorkerRole, decode, encode
from infx.supervisor.sockets import AdoptedEndpoint, bind_group, bind_one, listen_address
from protocol.discovery.peers import PeerAdded, PeerAddress
from protocol.supervisor.siblings import workers_header


def test_a_role_and_the_config_travel_whole_as_one_line():
    config = build_config({}, {"peers": "10.0.0.2:8083", "echo_models": "a,b", "internal_secret": "s3cret",
                               "workers": "2"})
    role = WorkerRole(index=1, count=2, pod_name="pod-w1", fds={"http": 4}, families={"http": socket.AF_INET},
                      internal_ports=(8083, 8084), siblings={"pod": ("127.0.0.1", 8083)}, metrics_ports=(1, 2),
                      log_text=True)
    line = encode(config, role)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line) == (config, role)


def test_workers_share_tcp_and_ssl_endpoints_and_refuse_others():
    assert listen_address("tcp:8080:interface=127.0.0.1", "--http").interface == "127.0.0.1"
    six = listen_address("tcp6:8080:interface=\\:\\:1", "--http")
    assert six.family == socket.AF_INET6 and six.interface == "::1"
    with pytest.raises(ConfigError, match="cannot be shared by --workers"):
        listen_address("unix:/tmp/infx.sock", "--http")


def test_a_group_shares_one_port_and_a_taken_port_fails_as_one_process_does():
    address = listen_address("tcp:0:interface=127.0.0.1", "--http")
    group = bind_group(address, "--http", 3)
    try:
        ports = {sock.getsockname()[1] for sock in group}
        assert len(ports) == 1
        taken = listen_address(f"tcp:{ports.pop()}:interface=127.0.0.1", "--http")
        with pytest.raises(ListenFailed, match=r"--http: cannot listen on tcp:\d+:interface=127.0.0.1: port \d+ "
                                               r"is already in use"):
            bind_group(taken, "--http", 2)
    finally:
        for sock in group:
            sock.close()


def test_a_group_on_port_0_holds_the_kernels_pick_from_the_start(monkeypatch):
    """Another process takes a port the moment a socket on it lets go (a busy machine's outgoing
    connections draw from the same range): the group must never release the port it was given."""
    thieves: list[socket.socket] = []
    real_close = socket.socket.close

    def close_then_steal(sock: socket.socket) -> None:
        try:
            port = sock.getsockname()[1]
        except OSError:
            port = 0
        real_close(sock)
        if port and not thieves:
            thief = socket.socket()
            try:
                thief.bind(("127.0.0.1", port))
                thief.listen()
            except OSError:
                real_close(thief)
                return
            thieves.append(thief)

    monkeypatch.setattr(socket.socket, "close", close_then_steal)
    group: list[socket.socket] = []
    try:
        group = bind_group(listen_address("tcp:0:interface=127.0.0.1", "--http"), "--http", 2)
        assert len({sock.getsockname()[1] for sock in group}) == 1
        assert not thieves
    finally:
        monkeypatch.undo()
        for sock in [*group, *thieves]:
            sock.close()


@pytest_twisted.inlineCallbacks
def test_an_adopted_socket_serves_connections():
    sock = bind_one(listen_address("tcp:0:interface=127.0.0.1", "--http"), "--http")
    port_number = sock.getsockname()[1]
    fd = sock.detach()
    got = defer.Deferred()

    class Hello(Protocol):
        def connectionMade(self):
            self.transport.write(b"hello")
            self.transport.loseConnection()

    port = yield AdoptedEndpoint(reactor, fd, socket.AF_INET, "tcp:0").listen(Factory.forProtocol(Hello))
    try:
        def read():
            with socket.create_connection(("127.0.0.1", port_number), timeout=5) as client:
                return client.recv(5)

        from twisted.internet import threads

        got = yield threads.deferToThread(read)
        assert got == b"hello"
    finally:
        yield port.stopListening()


def test_the_peer_source_adds_the_siblings_and_each_peers_other_workers():
    changes = []

    class Static:
        def __init__(self, on_change):
            self.on_change = on_change
            self.peers = {}

        def start(self):
            self.peers = {"b": PeerAddress("10.0.0.2", 8083)}
            self.on_change(PeerAdded("b", self.peers["b"]))

        def stop(self):
            return defer.succeed(None)

    source = SiblingPeerSource({"pod-w1": PeerAddress("127.0.0.1", 8084)}, Static, changes.append)
    assert source.peers == {}
    source.start()
    assert source.peers == {"pod-w1": PeerAddress("127.0.0.1", 8084), "b": PeerAddress("10.0.0.2", 8083)}
    count = len(changes)
    source.dial_accepted("b", PeerAddress("10.0.0.2", 8083), [workers_header([8083, 8084])])
    assert len(changes) == count + 1
    assert source.peers["10.0.0.2:8084"] == PeerAddress("10.0.0.2", 8084)


def test_every_workers_series_are_merged_under_one_family_each_labelled_with_its_worker():
    registries = []
    for requests in (3, 5):
        registry = CollectorRegistry()
        counter = Counter("infx_http_requests", "requests", ["status"], registry=registry)
        counter.labels("200").inc(requests)
        registries.append(registry)
    from prometheus_client import generate_latest

    sibling = text_string_to_metric_families(generate_latest(registries[1]).decode())
    text = render(labelled([("0", registries[0].collect()), ("1", sibling)])).decode()
    assert text.count("# TYPE infx_http_requests") == 1
    samples = {(s.labels["worker"], s.labels["status"]): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "infx_http_requests_total"}
    assert samples == {("0", "200"): 3.0, ("1", "200"): 5.0}
