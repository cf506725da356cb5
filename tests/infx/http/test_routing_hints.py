"""The gateway computes routing hints once at admission, from the client's own JSON and headers."""

import pytest_twisted
from twisted.internet import threads

from tests.support.http_api import client, gateway_factory  # noqa: F401 (the fixture)

SYSTEM = {"role": "system", "content": "You answer questions about ships. " * 20}


@pytest_twisted.inlineCallbacks
def test_a_conversation_s_turns_reach_the_runner_with_shared_prefix_blocks(gateway_factory):  # noqa: F811
    runner, _, base = yield gateway_factory()
    turn1 = [SYSTEM, {"role": "user", "content": "What is a brig? " * 20}]
    turn2 = turn1 + [{"role": "assistant", "content": "A two-masted ship. " * 20}, {"role": "user", "content": "And?"}]

    def converse():
        c = client(base)
        c.chat.completions.create(model="m", messages=turn1, user="ann")
        c.chat.completions.create(model="m", messages=turn2, user="ann")
        c.embeddings.create(model="m", input="x")

    yield threads.deferToThread(converse)
    first, second, embedding = (s.routing_hints for s in runner.submissions)
    assert len(first.blocks) >= 4 and second.blocks[:len(first.blocks)] == first.blocks
    assert first.home == second.home and first.session == "ann" and first.adapter == "m"
    assert embedding is None


@pytest_twisted.inlineCallbacks
def test_a_session_header_names_the_session(gateway_factory):  # noqa: F811
    runner, _, base = yield gateway_factory()
    yield threads.deferToThread(lambda: client(base).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-session-id": "s-9"}))
    assert runner.submissions[0].routing_hints.session == "s-9"


@pytest_twisted.inlineCallbacks
def test_the_gateway_cuts_prompts_as_its_hints_config_says(gateway_factory):  # noqa: F811
    from protocol.routing.hints import HintsConfig

    runner, gateway, base = yield gateway_factory()
    messages = [SYSTEM, {"role": "user", "content": "What is a brig?"}]
    yield threads.deferToThread(lambda: client(base).chat.completions.create(model="m", messages=messages))
    gateway.hints = HintsConfig(block_bytes=64, max_blocks=3)  # --routing-block-bytes 64 --routing-max-blocks 3
    yield threads.deferToThread(lambda: client(base).chat.completions.create(model="m", messages=messages))
    default, small = (s.routing_hints for s in runner.submissions)
    assert len(small.blocks) == 3 > len(default.blocks) and small.blocks[0] != default.blocks[0]


@pytest_twisted.inlineCallbacks
def test_no_hints_are_made_for_a_policy_that_reads_none(gateway_factory):  # noqa: F811
    runner, gateway, base = yield gateway_factory()
    gateway.hints = None  # what the service gives the API unless the policy is affinity
    yield threads.deferToThread(lambda: client(base).chat.completions.create(
        model="m", messages=[SYSTEM, {"role": "user", "content": "hi"}], extra_headers={"x-session-id": "s-9"}))
    assert runner.submissions[0].routing_hints is None


@pytest_twisted.inlineCallbacks
def test_the_gateway_makes_hints_only_where_its_routing_policy_reads_them():
    from twisted.internet import reactor

    from infx.config import build_config
    from infx.service import build_gateway

    ports = {name: "tcp:0:interface=127.0.0.1" for name in ("http", "worker_grpc", "internal_grpc")}
    for policy, made in (("affinity", True), ("round_robin", False), ("least_in_progress", False)):
        gateway = build_gateway(reactor, build_config({"routing_policy": policy, "grace_period": 1}, ports))
        yield gateway.startService()
        try:
            assert (gateway.gateway.hints is not None) is made, policy
        finally:
            yield gateway.stopService()
