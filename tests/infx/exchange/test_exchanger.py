"""The task exchanger in one process over real loopback sockets: gateways lend each other
their engines, reports never loop, the secret is enforced, receivers follow the pod source
and redial with backoff, and a draining gateway lets forwarded tasks finish."""

from __future__ import annotations

import random
from typing import Any, Callable

import openai
import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task, threads

from harness.scaler_fakes import InMemoryServiceQuery
from infx.config import build_config
from infx.exchange.exchanger import Exchanger, ExchangerConfig
from infx.scaling.scaler import InferenceScaler
from infx.service import GatewayService, builtin_engine_id
from protocol.backoff import Backoff
from protocol.discovery.peers import PeerAdded, PeerAddress, PeerAddressChanged, PeerChange, PeerRemoved
from protocol.gateway.dialling import DialState
from protocol.processor.keys import Locality
from tests.support.exchange import LOOPBACK, base_url, chat, engines, gateways, internal_address, until


def key_file(tmp_path: Any, keys: list[dict[str, Any]]) -> Any:
    """A key file with ``keys`` and the engine key of tenant ``team``."""
    import yaml

    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": keys, "engine_keys": [{"key": "ek-team", "tenant": "team"}]}))
    return path


def team_engine(gateway: GatewayService, token_delay: float) -> Any:
    """An echo engine of tenant ``team`` serving ``m``, started and attached to ``gateway``."""
    from infx.agent.engine import EngineAgent, GrpcLinks
    from infx.agent.runtimes import EchoRuntime
    from infx.transport import GrpcChannel, client_endpoint
    from protocol.agent.core import EngineAgentCore
    from protocol.agent.effects import AgentConfig
    from protocol.agent.echo import EchoConfig

    worker = gateway.worker_grpc.port.getHost().port
    engine = EngineAgent(reactor, EngineAgentCore(AgentConfig(engine_id="e-team", models=("m",))),
                         EchoRuntime(reactor, EchoConfig(token_delay=token_delay)),
                         GrpcLinks(reactor, lambda: GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", worker)),
                                   key="ek-team"),
                         grace=1)
    engine.startService()
    return engine


@pytest_twisted.inlineCallbacks
def test_engine_of_a_peer_serves_requests_arriving_here_and_is_never_re_advertised(gateways):
    c = yield gateways("c")
    a = yield gateways("a", peers=internal_address(c))
    # b dials a and reports its local engine there.
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})

    reply = yield threads.deferToThread(chat, base_url(a), model="m")
    assert reply.choices[0].message.content == "hello infx world"

    def streamed() -> str:
        return "".join(c.choices[0].delta.content or "" for c in chat(base_url(a), model="m", stream=True) if c.choices)

    assert (yield threads.deferToThread(streamed)) == "hello infx world"
    # a dials c, but reports only its local engines (none): b's engine does not travel on.
    # (That no later report carries it either, status interval after status interval, is
    # pinned on a hand-stepped clock in tests/protocol/gateway/test_core.py.)
    yield until(lambda: [s.pod_name for s in c.exchanger.streams] == ["a"])
    assert engines(c) == {}
    assert engines(b) == {("default", Locality.LOCAL): 1}
    assert a.processor.status()["tasks"] == 0 and b.processor.status()["tasks"] == 0
    # Both requests crossed: out of a, into b.
    assert a.registry.get_sample_value("infx_exchanged_tasks_total", {"direction": "out"}) == 2
    assert b.registry.get_sample_value("infx_exchanged_tasks_total", {"direction": "in"}) == 2


@pytest_twisted.inlineCallbacks
def test_a_peer_with_the_wrong_secret_is_refused_and_its_receiver_keeps_redialling(gateways):
    a = yield gateways("a", internal_secret="right")
    b = yield gateways("b", echo_models="m", peers=internal_address(a), internal_secret="wrong")
    receiver = b.exchanger.receivers[internal_address(a)]
    yield until(lambda: receiver.failures >= 2)
    assert receiver.streams_opened == 0
    assert engines(a) == {} and a.exchanger.streams == set()


@pytest_twisted.inlineCallbacks
def test_the_same_secret_on_both_sides_lets_engines_through(gateways):
    a = yield gateways("a", internal_secret="s3cret")
    yield gateways("b", echo_models="m", peers=internal_address(a), internal_secret="s3cret")
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})


@pytest_twisted.inlineCallbacks
def test_a_peer_that_stops_takes_its_engines_with_it_and_its_return_restores_them(gateways):
    a = yield gateways("a")
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    yield b.stopService()
    assert engines(a) == {}
    # a stream from a new b (same pod name) registers the engine again.
    yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})


@pytest_twisted.inlineCallbacks
def test_a_newer_stream_from_the_same_pod_replaces_the_older_one(gateways):
    a = yield gateways("a")
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: len(a.exchanger.streams) == 1 and engines(a) == {("default", Locality.REMOTE): 1})
    first = next(iter(a.exchanger.streams))
    # A second dialler reporting under the same pod name: b reconnected over a new connection.
    twin = yield gateways("b", peers=internal_address(a))
    yield until(lambda: first not in a.exchanger.streams and len(a.exchanger.streams) == 1)
    assert first.closed
    # The twin has no engines: its report replaced b's registration.
    assert engines(a) == {}
    assert twin.exchanger.receivers[internal_address(a)].streams_opened == 1


@pytest_twisted.inlineCallbacks
def test_requests_a_peer_accepted_reach_this_gateways_scaler_as_started_requests(gateways):
    """b accepts 5 requests and a 2, which a forwards to b's engine: b reports 5 (forwarded
    tasks are not b's clients' requests), and a's scaler, hooked up as ``--scaler`` does,
    counts them as started there. Its baseline goes with b's stream."""
    a = yield gateways("a")
    scaler = InferenceScaler(reactor, InMemoryServiceQuery())
    a.exchanger.on_peer_requests.append(scaler.observe_peer_requests)
    a.exchanger.on_peer_gone.append(scaler.forget_peer)
    gone: list[Any] = []
    a.exchanger.on_peer_gone.append(gone.append)
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})  # b's reports arrive
    for base, count in ((base_url(b), 5), (base_url(a), 2)):
        for _ in range(count):
            yield threads.deferToThread(chat, base, model="m")
    assert b.dispatcher.requests_started == {"m": 5} and a.dispatcher.requests_started == {"m": 2}

    def started_at_peers() -> float:
        stable, _ = scaler.machine.started_rates("m", reactor.seconds())
        return round(stable * scaler.machine.config.stable_window, 6)

    yield until(lambda: started_at_peers() == 5)
    [stream] = a.exchanger.streams
    yield b.stopService()
    yield until(lambda: gone == [stream])


@pytest_twisted.inlineCallbacks
def test_the_builtin_engines_of_two_peers_are_two_engines_here_and_one_leaves_with_its_gateway(gateways):
    """Issue 22 item 2 over real sockets: b and c each run a built-in echo engine (once both
    named builtin-echo, and a learned only the first). a reaches each, by its own id on the
    wire, and loses only b's when b stops."""
    a = yield gateways("a")
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    c = yield gateways("c", echo_models="n", peers=internal_address(a))
    names = {f"{builtin_engine_id(g.pod_name)}@{g.pod_name}": g.pod_name for g in (b, c)}
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 2})
    assert {name: a.processor.engine("default", name).route.pod_name for name in names} == names
    assert a.dispatcher.models("default") == ["m", "n"]
    for model in ("m", "n"):
        reply = yield threads.deferToThread(chat, base_url(a), model=model)
        assert reply.choices[0].message.content == "hello infx world"
    yield b.stopService()
    yield until(lambda: a.dispatcher.models("default") == ["n"])
    assert engines(a) == {("default", Locality.REMOTE): 1}


class FakePods:
    """A pod source driven by the test: the peers it holds are what reconcile reads."""

    def __init__(self, on_change: Callable[[PeerChange], None]) -> None:
        self.on_change = on_change
        self.peers: dict[str, PeerAddress] = {}
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> defer.Deferred[None]:
        self.stopped = True
        return defer.succeed(None)

    def change(self, change: PeerChange) -> None:
        if isinstance(change, PeerRemoved):
            del self.peers[change.name]
        else:
            self.peers[change.name] = change.address
        self.on_change(change)


class RefusingEndpoint:
    """A client endpoint whose every connection attempt is refused at once."""

    def __init__(self) -> None:
        self.attempts = 0

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        self.attempts += 1
        return defer.fail(ConnectionRefusedError())


def clocked_exchanger(connect: Callable[[PeerAddress], Any], backoff: Backoff, seed: int = 1):
    """An exchanger over its own dispatcher and core on a ``task.Clock``, with a FakePods source."""
    from prometheus_client import CollectorRegistry

    from infx.gateway.dispatcher import Dispatcher
    from infx.gateway.metrics import GatewayMetrics
    from protocol.gateway.effects import CoreConfig
    from protocol.processor.core import Processor

    clock = task.Clock()
    dispatcher = Dispatcher(clock, Processor(), GatewayMetrics(CollectorRegistry()),
                            config=CoreConfig("x", redial_backoff=backoff), rng=random.Random(seed))
    pods: list[FakePods] = []
    exchanger = Exchanger(clock, dispatcher, ExchangerConfig("x"), lambda cb: pods.append(FakePods(cb)) or pods[0],
                          connect)
    exchanger.start()
    return clock, exchanger, pods[0]


def test_receivers_follow_the_pod_source_one_per_live_pod_at_its_current_address():
    from infx.transport import GrpcChannel

    channels: list[PeerAddress] = []
    endpoint = RefusingEndpoint()

    def connect(address: PeerAddress):
        channels.append(address)
        return GrpcChannel(clock, endpoint)

    clock, exchanger, source = clocked_exchanger(connect, Backoff(initial=0.05, cap=0.1))
    b_addr, b_moved = PeerAddress("127.0.0.1", 1), PeerAddress("127.0.0.1", 2)
    source.change(PeerAdded("b", b_addr))
    source.change(PeerAdded("c", PeerAddress("127.0.0.1", 3)))
    first = exchanger.receivers["b"]
    assert {name: r.address for name, r in exchanger.receivers.items()} == {"b": b_addr, "c": PeerAddress("127.0.0.1", 3)}
    source.change(PeerAddressChanged("b", b_addr, b_moved))
    assert exchanger.receivers["b"].address == b_moved and exchanger.receivers["b"] is not first
    assert first.state is DialState.STOPPED
    source.change(PeerRemoved("c", PeerAddress("127.0.0.1", 3)))
    assert list(exchanger.receivers) == ["b"]
    # Nothing listens at b's address: the receiver redials with backoff, never giving up.
    for _ in range(40):
        clock.advance(0.05)
    assert exchanger.receivers["b"].failures >= 3
    same = exchanger.receivers["b"]
    source.change(PeerAdded("b", b_moved))  # the same state: the same receiver
    assert exchanger.receivers["b"] is same
    drained = exchanger.drain()
    for _ in range(10):
        clock.advance(0.1)  # the stream being dialled fails; no redial follows
    assert drained.called
    stopped = exchanger.stop()
    clock.advance(0)
    assert stopped.called and source.stopped
    assert same.state is DialState.STOPPED and dict(exchanger.receivers) == {}
    source.change(PeerAdded("b", b_moved))  # shutting down: no receiver is created again
    assert dict(exchanger.receivers) == {}
    assert channels.count(b_moved) >= 3


def test_a_receiver_whose_channel_factory_fails_is_redialled_after_a_backoff_delay():
    from infx.transport import GrpcChannel

    calls: list[PeerAddress] = []
    endpoint = RefusingEndpoint()

    def connect(address: PeerAddress):
        calls.append(address)
        if len(calls) == 1:
            raise RuntimeError("a broken channel factory")
        return GrpcChannel(clock, endpoint)

    clock, exchanger, source = clocked_exchanger(connect, Backoff(initial=0.05, cap=0.1))
    source.change(PeerAdded("b", PeerAddress("127.0.0.1", 1)))
    assert len(calls) == 1 and exchanger.receivers["b"].state is DialState.CONNECTING
    clock.advance(0)  # the failure is reported once the effects at hand are done
    assert exchanger.receivers["b"].state is DialState.BACKING_OFF
    source.change(PeerAdded("b", PeerAddress("127.0.0.1", 1)))  # no change: no dial before the delay
    assert len(calls) == 1
    clock.advance(0.05)
    assert len(calls) == 2 and exchanger.receivers["b"].state is not DialState.STOPPED
    exchanger.stop()
    clock.advance(1)
    assert len(calls) == 2


@pytest_twisted.inlineCallbacks
def test_draining_receiver_reports_not_ready_then_half_closes_once_forwarded_tasks_ended(gateways):
    a = yield gateways("a")
    b = yield gateways("b", echo_models="m", peers=internal_address(a))
    yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1})
    receiver = b.exchanger.receivers[internal_address(a)]
    yield b.exchanger.drain()
    assert receiver.state is DialState.STOPPED
    # a saw the stream end cleanly: b's engine is gone there, and no stream is left.
    yield until(lambda: engines(a) == {} and a.exchanger.streams == set())


# --- the receiver's redial schedule, on a hand-stepped clock ---------------------------------


def test_an_unreachable_peer_is_redialled_after_jittered_exponential_delays_up_to_the_cap():
    from infx.transport import GrpcChannel

    endpoint = RefusingEndpoint()
    backoff = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.5)
    clock, exchanger, source = clocked_exchanger(lambda address: GrpcChannel(clock, endpoint), backoff, seed=7)
    source.change(PeerAdded("b", PeerAddress("10.0.0.2", 8083)))
    clock.advance(0)
    receiver = exchanger.receivers["b"]
    expected_rng = random.Random(7)
    for failures in range(1, 7):
        assert endpoint.attempts == failures and receiver.state is DialState.BACKING_OFF
        delay = backoff.delay(failures, expected_rng.random())
        assert 0.5 * min(5.0, 2.0 ** (failures - 1)) <= delay <= 1.5 * min(5.0, 2.0 ** (failures - 1))
        clock.advance(delay * 0.999)
        assert endpoint.attempts == failures  # not before its time
        clock.advance(delay * 0.001 + 1e-9)
        clock.advance(0)
    assert receiver.failures == endpoint.attempts == 7
    d = exchanger.stop()
    clock.advance(60)
    assert d.called and receiver.state is DialState.STOPPED
    assert endpoint.attempts == 7  # none after stop


# --- remote violations, over loopback -----------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_a_peer_that_sends_results_before_any_status_or_an_empty_message_is_cut_off(gateways):
    from infx.exchange.exchanger import PROCESS_TASKS_INTERNAL
    from infx.transport import GrpcChannel, client_endpoint
    from protocol.grpc import StatusCode
    from protocol.pb import internal_pb2, worker_pb2

    a = yield gateways("a", echo_models="m")
    port = a.internal_grpc.port.getHost().port
    channel = GrpcChannel(reactor, client_endpoint(reactor, "127.0.0.1", port))
    try:
        def open_call():
            return channel.stream(PROCESS_TASKS_INTERNAL, internal_pb2.ProcessTasksInternalRequest.SerializeToString,
                                  internal_pb2.ProcessTasksInternalResponse.FromString)

        call = open_call()
        yield call.send(internal_pb2.ProcessTasksInternalRequest(task_result=worker_pb2.TaskResult(task_id="x")))
        status = yield call.status()
        assert status.code == StatusCode.FAILED_PRECONDITION

        call = open_call()
        yield call.send(internal_pb2.ProcessTasksInternalRequest(server_status=internal_pb2.ServerStatus(pod_name="z")))
        yield call.send(internal_pb2.ProcessTasksInternalRequest())
        status = yield call.status()
        assert status.code == StatusCode.INVALID_ARGUMENT
        assert a.exchanger.streams == set()
    finally:
        yield channel.close()


@pytest_twisted.inlineCallbacks
def test_a_peer_that_forwards_a_task_without_an_id_is_cut_off_and_redialled(gateways):
    from infx.exchange.exchanger import PROCESS_TASKS_INTERNAL
    from infx.transport import CallKind, GrpcServer, listen_grpc
    from protocol.grpc import GrpcConfig
    from protocol.pb import internal_pb2

    server = GrpcServer(reactor, GrpcConfig(client_side=False))
    served: list[int] = []

    async def misbehave(call):
        served.append(1)
        call.send_initial_metadata()
        await call.recv()  # the status report
        await call.send(internal_pb2.ProcessTasksInternalResponse(tenant_id="t"))
        await call.when_cancelled()

    server.add_method(PROCESS_TASKS_INTERNAL, misbehave, internal_pb2.ProcessTasksInternalRequest.FromString,
                      internal_pb2.ProcessTasksInternalResponse.SerializeToString, kind=CallKind.STREAM_STREAM)
    port = yield listen_grpc(reactor, "tcp:0:interface=127.0.0.1", server)
    b = yield gateways("b", echo_models="m", peers=f"127.0.0.1:{port.getHost().port}")
    try:
        receiver = next(iter(b.exchanger.receivers.values()))
        yield until(lambda: receiver.streams_opened >= 2)
        assert b.processor.status()["tasks"] == 0
    finally:
        yield b.stopService()
        yield port.stopListening()


# --- tenants travel with engines and tasks -------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_a_peer_engine_serves_only_its_own_tenant_here(gateways, tmp_path):
    keys = key_file(tmp_path, [{"key": "sk-team", "tenant": "team"}, {"key": "sk-other", "tenant": "other"}])
    a = yield gateways("a", api_keys=str(keys))
    b = yield gateways("b", api_keys=str(keys), peers=internal_address(a))
    engine = team_engine(b, token_delay=0)
    try:
        yield until(lambda: engines(a) == {("team", Locality.REMOTE): 1})
        client = openai.OpenAI(base_url=base_url(a), api_key="sk-team", max_retries=0, timeout=10)
        reply = yield threads.deferToThread(
            client.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi there"}])
        assert reply.choices[0].message.content == "hi there"
        other = openai.OpenAI(base_url=base_url(a), api_key="sk-other", max_retries=0, timeout=10)
        with pytest.raises(openai.NotFoundError):
            yield threads.deferToThread(
                other.chat.completions.create, model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        yield engine.stopService()


# --- twistd infx options ------------------------------------------------------------------------------


def test_exchange_options_reach_the_config_and_conflicts_are_usage_errors(tmp_path):
    from twisted.python import usage

    from infx.tap import GatewayOptions

    options = GatewayOptions()
    options.parseOptions(["--internal-grpc", "tcp:9083:interface=127.0.0.2", "--peers", "127.0.0.3:9083,127.0.0.4:9083",
                          "--internal-secret", "s", "--status-interval", "2.5"])
    config = options.config_value
    assert (config.internal_grpc, config.peers, config.internal_secret, config.status_interval, config.kube) == (
        "tcp:9083:interface=127.0.0.2", ("127.0.0.3:9083", "127.0.0.4:9083"), "s", 2.5, False)
    assert config.effective_peer_port == 9083

    yaml_file = tmp_path / "infx.yaml"
    yaml_file.write_text("kube: true\npeer_port: 7000\n")
    options = GatewayOptions()
    options.parseOptions(["--config", str(yaml_file), "--pod-label", "role=gateway"])
    assert options.config_value.kube  # an absent --kube flag leaves the file's value alone
    assert options.config_value.pod_label_pair == ("role", "gateway")
    assert options.config_value.effective_peer_port == 7000

    with pytest.raises(usage.UsageError, match="exclusive"):
        GatewayOptions().parseOptions(["--kube", "--peers", "127.0.0.3:9083"])
    with pytest.raises(usage.UsageError, match="pod-label"):
        GatewayOptions().parseOptions(["--kube", "--pod-label", "nolabel"])


def test_the_pod_name_defaults_to_pod_name_else_the_internal_listen_address():
    config = build_config({}, {"internal_grpc": "tcp:9083:interface=127.0.0.2"})
    assert GatewayService(reactor, config, environ={"POD_NAME": "gw-0"}).exchanger.config.pod_name == "gw-0"
    assert GatewayService(reactor, config, environ={}).exchanger.config.pod_name == "127.0.0.2:9083"


@pytest_twisted.inlineCallbacks
def test_a_gateway_on_internal_port_0_is_named_and_dialled_back_by_the_port_the_kernel_picked():
    """One process names itself by its internal port: on port 0 the kernel's pick, known only once
    bound. Bound as the gateway is built, it is the name, the built-in engine's id and the port
    peers dial back (b dials a back there, so a learns b's engine); a named pod keeps its name."""
    started: list[GatewayService] = []

    @defer.inlineCallbacks
    def start(environ: dict[str, str], **options: Any) -> Any:
        config = build_config({}, {"http": LOOPBACK, "worker_grpc": LOOPBACK, "internal_grpc": LOOPBACK,
                                   "status_interval": 0.5, **options})
        gateway = GatewayService(reactor, config, environ=environ)
        started.append(gateway)
        gateway.startService()
        yield gateway.when_listening()
        return gateway, gateway.internal_grpc.port.getHost().port

    try:
        b, b_port = yield start({}, echo_models="m")
        assert b_port != 0 and b.pod_name == f"127.0.0.1:{b_port}" == b.exchanger.config.pod_name
        assert b.exchanger.config.peer_port == b_port
        yield until(lambda: list(b.dispatcher.status()["tenants"].get("default", {}).get("engines", {}))
                    == [builtin_engine_id(b.pod_name)])
        a, a_port = yield start({}, peers=f"127.0.0.1:{b_port}")
        assert a.pod_name == f"127.0.0.1:{a_port}" and a.exchanger.config.peer_port == a_port
        yield until(lambda: engines(a) == {("default", Locality.REMOTE): 1}, timeout=20)
        assert {stream.pod_name for stream in b.exchanger.streams} == {a.pod_name}
        named, named_port = yield start({"POD_NAME": "gw-0"})
        assert named.pod_name == "gw-0" and named.exchanger.config.peer_port == named_port != 0
    finally:
        for gateway in reversed(started):
            yield gateway.stopService()


@pytest_twisted.inlineCallbacks
def test_a_forwarded_task_holds_its_slot_at_the_engines_gateway_for_its_caller(gateways, tmp_path):
    """The caller crosses the exchange with the task: the engine's gateway counts the slot for
    the key's name, as fairness by slots held needs (weight and criticality ride along too:
    tests/protocol/exchange/test_receiver.py, tests/protocol/processor/test_fair_share.py)."""
    keys = key_file(tmp_path, [{"key": "sk-app", "tenant": "team", "name": "app", "weight": 3,
                                "criticality": "critical"}])
    a = yield gateways("a", api_keys=str(keys), max_in_flight_per_engine=4)
    b = yield gateways("b", api_keys=str(keys), peers=internal_address(a), max_in_flight_per_engine=4)
    engine = team_engine(b, token_delay=0.2)
    try:
        yield until(lambda: engines(a) == {("team", Locality.REMOTE): 1})
        client = openai.OpenAI(base_url=base_url(a), api_key="sk-app", max_retries=0, timeout=10)
        reply = threads.deferToThread(
            client.chat.completions.create, model="m", messages=[{"role": "user", "content": "one two three four"}])
        yield until(lambda: b.processor.slots_held("team", "m") == {"app": 1})
        assert a.processor.slots_held("team", "m") == {"app": 1}
        assert (yield reply).choices[0].message.content == "one two three four"
        yield until(lambda: b.processor.slots_held("team", "m") == {} and a.processor.slots_held("team", "m") == {})
    finally:
        yield engine.stopService()
