"""Requests that arrive while a gateway drains (SIGTERM, ``--grace-period``), with real ``twistd``
processes: gateway A has a built-in echo engine and learns gateway B's engine over the exchange.
While A drains a long stream of its own, a request for a model B's engine serves is served through
B, and one that only A's engines served gets 503 with Retry-After at once, not after the grace period."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest
import openai

from harness.twistd_processes import Engine, Gateway, wait_until

WORDS = " ".join(f"w{i}" for i in range(100))


def post_chat(gateway: Gateway, model: str) -> tuple[int, dict[str, str], dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "x y"}]}).encode()
    request = urllib.request.Request(gateway.base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


@pytest.mark.slow
def test_a_draining_gateway_serves_new_requests_through_a_peer_or_refuses_them_at_once(tmp_path: Path) -> None:
    a = Gateway(tmp_path, name="a", extra=["--echo-models", "m,only-a", "--echo-token-delay", "0.05",
                                           "--grace-period", "60", "--status-interval", "0.5"])
    b = Gateway(tmp_path, name="b", extra=["--peers", f"127.0.0.1:{a.internal_port}", "--status-interval", "0.5"])
    engine = Engine(tmp_path, b, "echo-b", ["m"])
    try:
        wait_until(lambda: b.remote_engine_id("echo-b") in a.engines(), "a learns b's engine", [a.child, b.child])
        client = openai.OpenAI(base_url=a.base_url, api_key="x", max_retries=0, timeout=30)
        chunks = client.chat.completions.create(
            model="only-a", messages=[{"role": "user", "content": WORDS}], stream=True)
        pieces: list[str] = []
        during: list[tuple[int, dict[str, str], dict]] = []
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                if not pieces:
                    a.child.signal(signal.SIGTERM)
                    wait_until(lambda: a.readyz() == 503, "a drains", [a.child])
                    during = [post_chat(a, "m"), post_chat(a, "only-a")]
                pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces) == WORDS, "the stream in flight finishes within the grace period"
        (served_status, _, served), (refused_status, refused_headers, refused) = during
        assert served_status == 200 and served["choices"][0]["message"]["content"] == "x y"
        assert refused_status == 503
        assert int(refused_headers["retry-after"]) >= 1
        assert "shutting down" in refused["error"]["message"]
        assert a.child.wait(timeout=20) in (0, -signal.SIGTERM)  # twistd re-raises the signal it stopped on
        log = a.child.output()
        assert "model='m'" in log and f"engine='{b.remote_engine_id('echo-b')}'" in log, log[-3000:]
        assert "model='only-a' tenant='default' status=503" in log
    finally:
        engine.stop()
        b.stop()
        a.stop()
