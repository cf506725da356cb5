"""Every unknown-model 404 has one shape, whichever way the gateway came to know the model is unknown.

The official openai client over loopback against the real gateway, dispatcher and
core: a model refused at once (no engine lists it, learning is over), a model
whose request waited through start-up learning (a dialled peer never reported)
and ``GET /v1/models/{id}`` all answer the same body, with ``code``
``model_not_found`` and ``param`` ``model``.
"""

from __future__ import annotations

import json

import openai
import pytest
import pytest_twisted
from prometheus_client import CollectorRegistry
from twisted.internet import defer, reactor, task, threads
from twisted.internet.endpoints import TCP4ServerEndpoint

from infx.gateway.dispatcher import Dispatcher
from infx.gateway.metrics import GatewayMetrics
from infx.gateway.tasks import Availability
from infx.http.api import HttpApi
from infx.http.resources import build_resource
from infx.http.site import GatewaySite
from protocol.gateway.effects import CoreConfig
from protocol.openai.errors import ModelNotFoundError
from protocol.processor.core import Processor
from protocol.processor.config import ProcessorConfig

LEARNING_SECONDS = 5.0
TENANT = "default"  # the tenant of every request while API keys are off


@pytest.fixture
def learning_gateway():
    """A gateway that dials one peer which never reports, so it is learning until its clock is advanced.

    The dispatcher runs on a hand-stepped clock; the HTTP site on the reactor.
    """
    clock = task.Clock()
    metrics = GatewayMetrics(CollectorRegistry())
    dispatcher = Dispatcher(clock, Processor(ProcessorConfig()), metrics,
                            config=CoreConfig(pod_name="a", learn_peers_within=LEARNING_SECONDS))
    dispatcher.run(lambda now: dispatcher.core.peers_changed({"b": "b"}, now))
    gateway = HttpApi(dispatcher, reactor, metrics)
    gateway.listening = True
    site = GatewaySite(build_resource(gateway), max_body_size=1 << 20)
    ports = []

    def listening(port):
        ports.append(port)
        return clock, dispatcher, f"http://127.0.0.1:{port.getHost().port}"

    yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site).addCallback(listening)
    for port in ports:
        port.stopListening()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=10)


def chat(base: str, model: str, stream: bool = False):
    """A chat completion in a thread; the Deferred fires with the client's exception (or its answer)."""

    def call():
        try:
            answer = client(base).chat.completions.create(
                model=model, stream=stream, messages=[{"role": "user", "content": "x"}])
            return list(answer) if stream else answer
        except openai.APIStatusError as e:
            return e

    return threads.deferToThread(call)


def retrieve(base: str, model: str):
    def call():
        try:
            return client(base).models.retrieve(model)
        except openai.APIStatusError as e:
            return e

    return threads.deferToThread(call)


def requests_accepted(dispatcher: Dispatcher, count: int) -> defer.Deferred:
    """Fires once ``count`` requests were accepted (submitted to the core)."""
    accepted = defer.Deferred()
    models: list[str] = []

    def started(model: str) -> None:
        models.append(model)
        if len(models) == count:
            accepted.callback(models)

    dispatcher.on_request_started.append(started)
    return accepted


def assert_model_not_found(error: object, model: str) -> None:
    assert isinstance(error, openai.NotFoundError), error
    assert (error.status_code, error.code, error.param, error.type) == (
        404, "model_not_found", "model", "invalid_request_error")
    assert error.body == ModelNotFoundError(model).body()["error"]
    assert error.response.headers["content-type"] == "application/json"


@pytest_twisted.inlineCallbacks
def test_a_request_held_through_start_up_learning_ends_in_the_same_404_as_one_refused_at_once(learning_gateway):
    clock, dispatcher, base = yield learning_gateway
    model = "nobody-serves-it"
    assert dispatcher.availability(TENANT, model) is Availability.LEARNING
    accepted = requests_accepted(dispatcher, 2)
    held = chat(base, model)
    held_stream = chat(base, model, stream=True)
    yield accepted  # both wait in the queue for the peer's report, which never comes
    assert not held.called and not held_stream.called
    clock.advance(LEARNING_SECONDS)
    learned, learned_stream = yield defer.gatherResults([held, held_stream])
    assert_model_not_found(learned, model)
    assert_model_not_found(learned_stream, model)

    # Learning is over: the same model is refused at once, with the very same body.
    assert dispatcher.availability(TENANT, model) is Availability.UNKNOWN
    immediate = yield chat(base, model)
    assert_model_not_found(immediate, model)
    assert immediate.response.content == learned.response.content == learned_stream.response.content
    assert json.loads(learned.response.content) == ModelNotFoundError(model).body()
    # And so is the model's own page.
    page = yield retrieve(base, model)
    assert_model_not_found(page, model)
    assert page.response.content == immediate.response.content


@pytest_twisted.inlineCallbacks
def test_a_held_request_the_scaler_gives_up_on_with_404_keeps_its_reason_in_the_same_shape(learning_gateway):
    clock, dispatcher, base = yield learning_gateway
    accepted = requests_accepted(dispatcher, 1)
    held = chat(base, "scaled-away")
    yield accepted
    reason = "deployment ns/scaled-away no longer serves its models"
    dispatcher.run(lambda now: dispatcher.core.scaler_gave_up("scaled-away", 404, reason, now))
    error = yield held
    assert isinstance(error, openai.NotFoundError)
    assert (error.code, error.param, error.type, error.body["message"]) == (
        "model_not_found", "model", "invalid_request_error", reason)
    assert error.body == ModelNotFoundError("scaled-away", reason).body()["error"]
