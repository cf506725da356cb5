"""Which form of a request each engine gets (protocol.openai.task_forms), alone and inside the processor."""

from __future__ import annotations

from protocol.openai import task_forms
from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import FailRequest, Locality, Processor, ProcessorConfig, SendTask, TaskState
from tests.support.processor import engine_status, one, only

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":0,"top_k":5}'


def both_forms(stream: bool = False) -> worker_pb2.TaskRequest:
    """A chat request whose typed form is complete, with the verbatim request beside it."""
    typed = chat_pb2.CreateChatCompletionRequest(model="m", stream=stream)
    typed.messages.add(role="user").content.add(type="text", text="hi")
    request = worker_pb2.TaskRequest(chat_completion=typed)
    request.http_request.method = "POST"
    request.http_request.path = "/v1/chat/completions"
    request.http_request.body = BODY
    return request


def verbatim_only() -> worker_pb2.TaskRequest:
    request = task_forms.routing_fields("chat_completion", "m", True)
    request.http_request.path = "/v1/chat/completions"
    request.http_request.body = b'{"messages":[{"content":[{"type":"video_url"}]}]}'
    request.typed_request_incomplete = "Unsupported content part type 'video_url'"
    return request


def capable(engine_id: str, *models: str) -> status_pb2.EngineStatus:
    status = engine_status(engine_id, *models)
    status.infx_capabilities.append(task_forms.HTTP_REQUEST_CAPABILITY)
    return status


def test_a_capable_engine_gets_the_verbatim_request_and_only_the_routing_fields():
    out = task_forms.for_engine(both_forms(stream=True), capable("e", "m"))
    assert out.http_request.body == BODY
    assert out.chat_completion == chat_pb2.CreateChatCompletionRequest(model="m", stream=True)
    assert out.typed_request_incomplete == task_forms.ROUTING_FIELDS_ONLY


def test_a_llmariner_engine_gets_the_typed_request_without_the_body():
    request = both_forms()
    out = task_forms.for_engine(request, engine_status("e", "m"))
    assert not out.HasField("http_request")
    assert out.chat_completion == request.chat_completion
    assert request.HasField("http_request"), "the caller's request is left as it was"


def test_a_request_without_a_verbatim_form_goes_as_it_is():
    request = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="m"))
    assert task_forms.for_engine(request, capable("e", "m")) is request


def test_only_capable_engines_are_eligible_for_a_request_without_a_typed_form():
    assert task_forms.eligible(verbatim_only(), capable("e", "m"))
    assert not task_forms.eligible(verbatim_only(), engine_status("e", "m"))
    assert task_forms.eligible(both_forms(), engine_status("e", "m"))


def test_routing_fields_keep_stream_only_where_the_kind_has_it():
    assert task_forms.routing_fields("embedding", "m", True).embedding.model == "m"
    assert task_forms.routing_fields("model_response", "m", True).model_response.stream


def _processor() -> Processor:
    return Processor(ProcessorConfig(retry_delay=0))


def test_the_processor_routes_a_request_without_a_typed_form_past_llmariner_engines():
    p = _processor()
    p.update_engine("r-old", "t", engine_status("a-llmariner", "m"), Locality.LOCAL, 0)
    p.update_engine("r-infx", "t", capable("z-infx", "m"), Locality.LOCAL, 0)
    send = one(p.submit(task_id="1", tenant_id="t", request=verbatim_only(), origin="o", now=0), SendTask)
    assert send.engine.engine_id == "z-infx"
    assert send.task.request.http_request.body == verbatim_only().http_request.body


def test_each_engine_gets_its_own_form_and_a_retry_may_change_the_form():
    p = _processor()
    p.update_engine("r1", "t", capable("a", "m"), Locality.LOCAL, 0)
    p.update_engine("r2", "t", engine_status("b", "m"), Locality.LOCAL, 0)
    first = one(p.submit(task_id="1", tenant_id="t", request=both_forms(), origin="o", now=0), SendTask)
    assert first.engine.engine_id == "a" and first.task.request.HasField("http_request")
    retry = one(p.close_route("r1", "gone", 1), SendTask)
    assert retry.engine.engine_id == "b"
    assert not retry.task.request.HasField("http_request")
    assert len(retry.task.request.chat_completion.messages) == 1


def test_with_only_llmariner_engines_a_request_without_a_typed_form_fails_at_once_with_400():
    p = _processor()
    p.update_engine("r", "t", engine_status("e", "m"), Locality.LOCAL, 0)
    fail = one(p.submit(task_id="1", tenant_id="t", request=verbatim_only(), origin="o", now=0), FailRequest)
    assert fail.status == 400 and "video_url" in fail.message
    assert p.takes_http_request("t", "m") is False


def test_a_waiting_request_without_a_typed_form_waits_for_a_capable_engine():
    p = _processor()
    assert not only(p.submit(task_id="1", tenant_id="t", request=verbatim_only(), origin="o", now=0), SendTask)
    assert p.task_state("1") is TaskState.WAITING
    p.update_engine("r-c", "t", capable("c", "m"), Locality.LOCAL, 1)
    assert not p.has_task("1") or p.task_state("1") is TaskState.DISPATCHED


def test_an_arriving_llmariner_engine_fails_a_waiting_request_it_cannot_take_and_serves_the_next():
    p = _processor()
    p.submit(task_id="1", tenant_id="t", request=verbatim_only(), origin="o", now=0)
    p.submit(task_id="2", tenant_id="t", request=both_forms(), origin="o", now=0)
    effects = p.update_engine("r", "t", engine_status("e", "m"), Locality.LOCAL, 1)
    assert one(effects, FailRequest).task_id == "1"
    send = one(effects, SendTask)
    assert send.task.id == "2" and not send.task.request.HasField("http_request")


def test_a_targeted_task_in_a_form_its_engine_cannot_take_is_refused_with_503():
    p = _processor()
    p.update_engine("r", "t", engine_status("e", "m"), Locality.LOCAL, 0)
    effects = p.submit(task_id="1", tenant_id="t", request=verbatim_only(), origin="o", target_engine_id="e", now=0)
    assert one(effects, FailRequest).status == 503


def test_across_the_exchange_a_capable_engine_gets_the_verbatim_request_and_its_answer_comes_back_marked():
    """Gateway A (accepted peer) and gateway C (dialled peer, engine attached) back to back, as values."""
    from protocol.exchange.dialled_peer import DialledPeerConfig
    from protocol.exchange.accepted_peer import AcceptedPeer
    from protocol.pb import internal_pb2
    from protocol.processor.core import DeliverResult
    from tests.support.dialled_peer import BufferedReceiver

    a, c = _processor(), _processor()
    c.update_engine("engine-stream", "t", capable("engine-on-c", "m"), Locality.LOCAL, 0)
    dialled = BufferedReceiver(c, DialledPeerConfig("pod-c", status_interval=10))
    accepted_peer = AcceptedPeer(a)
    dialled.connected(0)
    for message in dialled.pop_messages():
        accepted_peer.message_received(message, 0)
    assert a.takes_http_request("t", "m")

    request = both_forms()
    to_peer = one(a.submit(task_id="1", tenant_id="t", request=request, origin="client", now=0), SendTask)
    assert to_peer.route is accepted_peer.route and to_peer.task.request.http_request.body == BODY
    assert not to_peer.task.request.chat_completion.messages, "the big body travels once"
    to_engine = one(dialled.task_received(internal_pb2.ProcessTasksInternalResponse(new_task=to_peer.task, tenant_id=to_peer.engine.tenant_id), 0), SendTask)
    assert to_engine.task.request.http_request == request.http_request
    answer = worker_pb2.TaskResult(task_id=to_engine.task.id, http_response=worker_pb2.HttpResponse(status_code=200),
                                   verbatim_answer=True)
    for effect in c.receive_result("engine-stream", answer, 1):
        dialled.deliver(effect)
    back = [one(accepted_peer.message_received(m, 1), DeliverResult) for m in dialled.pop_messages()]
    assert back[0].origin == "client" and back[0].result.verbatim_answer and back[0].last


def test_a_control_request_with_a_stray_verbatim_form_goes_alone_to_any_engine():
    request = worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest())
    request.http_request.path = "/x"
    for status in (capable("e", "m"), engine_status("e", "m")):
        out = task_forms.for_engine(request, status)
        assert out.WhichOneof("request") == "heartbeat" and not out.HasField("http_request")
    p = _processor()
    p.update_engine("r", "t", capable("e", "m"), Locality.LOCAL, 0)
    send = one(p.submit(task_id="1", tenant_id="t", request=request, origin="o", target_engine_id="e", now=0), SendTask)
    assert not send.task.request.HasField("http_request")


def deferred(body: bytes = BODY) -> worker_pb2.TaskRequest:
    """A chat request parsed while every engine took the verbatim form: no typed form built."""
    from protocol.openai.requests import parse_chat_completion
    from protocol.openai.verbatim import parse_json

    return parse_json("chat_completion", "/v1/chat/completions", body, parse_chat_completion,
                      typed_wanted=lambda model: False).request


def test_a_request_without_its_typed_form_goes_to_a_capable_engine_as_it_is():
    p = _processor()
    p.update_engine("r-infx", "t", capable("infx", "m"), Locality.LOCAL, 0)
    assert not p.typed_form_wanted("t", "m")
    send = one(p.submit(task_id="1", tenant_id="t", request=deferred(), origin="o", now=0), SendTask)
    assert send.task.request.typed_request_incomplete == task_forms.ROUTING_FIELDS_ONLY
    assert not send.task.request.chat_completion.messages and send.task.request.http_request.body == BODY


def test_a_waiting_request_gets_its_typed_form_built_for_the_llmariner_engine_that_arrives():
    p = Processor(ProcessorConfig(retry_delay=0, max_in_flight_per_engine=1))
    p.update_engine("r-infx", "t", capable("infx", "m"), Locality.LOCAL, 0)
    one(p.submit(task_id="1", tenant_id="t", request=deferred(), origin="o", now=0), SendTask)
    assert not only(p.submit(task_id="2", tenant_id="t", request=deferred(), origin="o", now=0), SendTask)
    assert p.task_state("2") is TaskState.WAITING
    send = one(p.update_engine("r", "t", engine_status("old", "m"), Locality.LOCAL, 1), SendTask)
    assert send.task.id == "2" and not send.task.request.HasField("http_request")
    assert send.task.request.chat_completion == both_forms().chat_completion
    assert p.typed_form_wanted("t", "m")


def test_a_request_without_its_typed_form_takes_a_llmariner_engine_when_the_capable_one_is_full():
    p = Processor(ProcessorConfig(retry_delay=0, max_in_flight_per_engine=1))
    p.update_engine("r-infx", "t", capable("infx", "m"), Locality.LOCAL, 0)
    one(p.submit(task_id="1", tenant_id="t", request=deferred(), origin="o", now=0), SendTask)
    p.update_engine("r-old", "t", engine_status("old", "m"), Locality.LOCAL, 0)
    send = one(p.submit(task_id="2", tenant_id="t", request=deferred(), origin="o", now=0), SendTask)
    assert send.engine.engine_id == "old" and len(send.task.request.chat_completion.messages) == 1


def test_a_request_whose_typed_form_cannot_be_built_fails_with_its_reason_when_only_llmariner_engines_remain():
    p = _processor()
    body = b'{"model":"m","messages":[{"role":"user","content":[{"type":"video_url","video_url":{"url":"u"}}]}]}'
    p.submit(task_id="1", tenant_id="t", request=deferred(body), origin="o", now=0)
    fail = one(p.update_engine("r", "t", engine_status("e", "m"), Locality.LOCAL, 1), FailRequest)
    assert fail.status == 400 and "video_url" in fail.message


def test_whether_the_typed_form_is_wanted_follows_what_the_engines_take():
    p = _processor()
    assert p.typed_form_wanted("t", "m"), "no engine known yet"
    p.update_engine("r", "t", capable("e", "m"), Locality.LOCAL, 0)
    assert not p.typed_form_wanted("t", "m") and p.typed_form_wanted("t", "other")
    p.update_engine("r", "t", engine_status("e", "m"), Locality.LOCAL, 1)
    assert p.typed_form_wanted("t", "m"), "it no longer takes the verbatim form"
    p.update_engine("r", "t", capable("e", "m"), Locality.LOCAL, 2)
    p.update_engine("r2", "t", engine_status("old", "m"), Locality.LOCAL, 2)
    assert p.typed_form_wanted("t", "m")
    p.close_route("r2", "gone", 3)
    assert not p.typed_form_wanted("t", "m")
    loading = Processor(ProcessorConfig(dynamic_model_loading=True))
    loading.update_engine("r", "t", capable("e", "m"), Locality.LOCAL, 0)
    assert not loading.typed_form_wanted("t", "any model: an engine may load it")
    loading.update_engine("r2", "t", engine_status("old", "n"), Locality.LOCAL, 0)
    assert loading.typed_form_wanted("t", "m")
