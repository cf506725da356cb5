"""The real openai client against the pure core (parser -> wire -> echo -> SSE -> back), over httpx's in-memory transport.

This pins down that what infx produces is what OpenAI's own client accepts:
bodies, streams, legacy completions and error bodies.
"""

import json

import openai
import pytest

try:  # the openai client's HTTP library: httpx2 from openai 3, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from protocol.agent.echo import EchoConfig, echo_task
from protocol.openai.completions import text_completion_body, text_completion_event_data
from protocol.openai.errors import OpenAIError
from protocol.openai.requests import parse_chat_completion, parse_completion, parse_embedding
from protocol.openai.sse import EventReceived, SSEParser, encode_event
from protocol.pb import worker_pb2

PARSERS = {"/v1/chat/completions": parse_chat_completion, "/v1/completions": parse_completion,
           "/v1/embeddings": parse_embedding}


def gateway(request: httpx.Request) -> httpx.Response:
    """A gateway in miniature: what infx/http/api.py does around these pure functions."""
    legacy = request.url.path == "/v1/completions"
    try:
        parsed = PARSERS[request.url.path](request.content)
    except OpenAIError as err:
        return httpx.Response(err.status, content=err.to_json(), headers={"content-type": "application/json"})
    results = echo_task(worker_pb2.Task(id="t", request=parsed.request), EchoConfig(token_delay=0), 1_700_000_000.0)
    head = results[0].result.http_response
    if not parsed.stream:
        body = text_completion_body(head.body) if legacy else head.body
        return httpx.Response(head.status_code, content=body, headers={"content-type": "application/json"})
    stream = b"".join(r.result.server_sent_event.data for r in results[1:])
    if legacy:
        events = SSEParser().receive_data(stream)
        stream = b"".join(encode_event(text_completion_event_data(e.data.encode()))
                          for e in events if isinstance(e, EventReceived))
    return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})


@pytest.fixture
def client():
    with httpx.Client(transport=httpx.MockTransport(gateway)) as http:
        yield openai.OpenAI(api_key="k", base_url="http://infx/v1", http_client=http, max_retries=0)


def test_chat_completion(client):
    completion = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi there"}])
    assert completion.choices[0].message.content == "hi there" and completion.usage.completion_tokens == 2


def test_streamed_chat_completion_with_usage(client):
    chunks = list(client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "one two three"}],
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
    assert chunks[-1].usage.total_tokens == 6


def test_legacy_completion_whole_and_streamed(client):
    assert client.completions.create(model="echo", prompt="a b c").choices[0].text == "a b c"
    chunks = list(client.completions.create(model="echo", prompt="a b c", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "a b c"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_embeddings_including_the_clients_default_base64(client):
    response = client.embeddings.create(model="e", input=["x", "y"], dimensions=8)
    assert [len(d.embedding) for d in response.data] == [8, 8]


def test_a_400_reaches_the_client_as_bad_request_with_param(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}], temperature=3)
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"
    assert json.loads(info.value.response.content)["error"]["param"] == "temperature"
