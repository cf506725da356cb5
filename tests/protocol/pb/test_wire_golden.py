"""Golden wire vectors: infx's messages encode to the bytes LLMariner's field numbers dictate.

Each expected value is written from the field numbers of LLMariner's
inference-manager api/v1 with the independent encoder in ``wire_bytes``; a
wrong number, type or nesting in ``proto/`` makes these fail.
"""

from protocol.pb import (
    chat_pb2,
    embeddings_pb2,
    internal_pb2,
    status_pb2,
    worker_pb2,
)
from tests.support.wire_bytes import I64, boolean, double, ld, tag, uint


def encode(message) -> bytes:
    return message.SerializeToString(deterministic=True)


def test_task_with_header_request_engine_and_timeout():
    task = worker_pb2.Task(
        id="t1",
        header={"X-Request-Id": worker_pb2.HeaderValue(values=["r1", "r2"])},
        request=worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest()),
        engine_id="e1",
        timeout_seconds=30,
    )
    header_entry = ld(1, "X-Request-Id") + ld(2, ld(1, "r1") + ld(1, "r2"))
    expected = (
        ld(1, "t1")
        + ld(3, header_entry)
        + ld(4, ld(6, b""))  # TaskRequest.heartbeat = 6
        + ld(5, "e1")
        + uint(6, 30)
    )
    assert encode(task) == expected


def test_task_request_oneof_members_use_llmariner_numbers():
    cases = [
        (worker_pb2.TaskRequest(go_away=worker_pb2.GoAwayRequest()), ld(5, b"")),
        (worker_pb2.TaskRequest(heartbeat=worker_pb2.HeartbeatRequest()), ld(6, b"")),
        (
            worker_pb2.TaskRequest(embedding=embeddings_pb2.CreateEmbeddingRequest(input="hi", model="m")),
            ld(2, ld(1, "hi") + ld(2, "m")),
        ),
        (
            worker_pb2.TaskRequest(
                embedding=embeddings_pb2.CreateEmbeddingRequest(
                    model="m", encoding_format="float", dimensions=8, user="u", encoded_input='["a","b"]'
                )
            ),
            ld(2, ld(2, "m") + ld(3, "float") + uint(4, 8) + ld(5, "u") + ld(6, '["a","b"]')),
        ),
    ]
    for message, expected in cases:
        assert encode(message) == expected, message


def test_audio_model_response_and_tokenize_requests():
    from protocol.pb import audio_pb2, model_response_pb2, tokenize_pb2

    audio = worker_pb2.TaskRequest(
        audio_transcription=audio_pb2.CreateAudioTranscriptionRequest(
            file=b"\x00\x01", filename="a.wav", model="w", prompt="p", language="en",
            response_format="json", stream=True, temperature=0.5,
        )
    )
    assert encode(audio) == ld(
        7,
        ld(1, b"\x00\x01") + ld(2, "a.wav") + ld(3, "w") + ld(4, "p") + ld(5, "en")
        + ld(6, "json") + boolean(7) + double(8, 0.5),
    )
    response = worker_pb2.TaskRequest(
        model_response=model_response_pb2.CreateModelResponseRequest(
            input="hi", encoded_input="", model="m", stream=True, encoded_tools="W10="
        )
    )
    assert encode(response) == ld(8, ld(3, "hi") + ld(9, "m") + boolean(18) + ld(30, "W10="))
    tokenize = worker_pb2.TaskRequest(
        tokenize_request=tokenize_pb2.TokenizeRequest(
            model="m", prompt="p", messages=[chat_pb2.ChatCompletionMessage(role="user")]
        )
    )
    assert encode(tokenize) == ld(9, ld(1, "m") + ld(2, "p") + ld(3, ld(2, "user")))


def test_cancel_task_is_an_infx_extension_at_field_100():
    message = worker_pb2.TaskRequest(cancel_task=worker_pb2.CancelTaskRequest(task_id="t9"))
    # tag for field 100, wire type 2 is the varint 802 = a2 06
    assert encode(message) == b"\xa2\x06" + bytes([4]) + ld(1, "t9")


def test_http_request_and_incomplete_typed_request_are_infx_extensions_at_101_and_102():
    message = worker_pb2.TaskRequest(
        chat_completion=chat_pb2.CreateChatCompletionRequest(model="m", stream=True),
        http_request=worker_pb2.HttpRequest(method="POST", path="/v1/completions", body=b'{"a":1}'),
        typed_request_incomplete="routing fields only",
    )
    http = ld(1, "POST") + ld(2, "/v1/completions") + ld(3, b'{"a":1}')
    chat = ld(2, "m") + boolean(13)  # CreateChatCompletionRequest.model = 2, stream = 13
    assert encode(message) == ld(1, chat) + ld(101, http) + ld(102, "routing fields only")


def test_a_llmariner_engine_reads_an_http_request_task_as_its_typed_request():
    message = worker_pb2.TaskRequest(
        embedding=embeddings_pb2.CreateEmbeddingRequest(model="m", input="hi"),
        http_request=worker_pb2.HttpRequest(method="POST", path="/v1/embeddings", body=b"{}"),
    )
    # A peer without fields 101/102 parses the same bytes: the oneof survives.
    assert encode(message).startswith(ld(2, ld(1, "hi") + ld(2, "m")))
    old = worker_pb2.TaskRequest.FromString(ld(2, ld(1, "hi") + ld(2, "m")) + ld(101, ld(2, "/x")))
    assert old.embedding.model == "m" and old.http_request.path == "/x"


def test_verbatim_answer_flag_is_an_infx_extension_at_field_100_of_task_result():
    result = worker_pb2.TaskResult(
        task_id="t1", http_response=worker_pb2.HttpResponse(status_code=200), verbatim_answer=True
    )
    assert encode(result) == ld(1, "t1") + ld(2, uint(1, 200)) + boolean(100)


def test_engine_capabilities_are_an_infx_extension_at_field_100_of_engine_status():
    status = status_pb2.EngineStatus(engine_id="e1", infx_capabilities=["http-request"])
    assert encode(status) == ld(1, "e1") + ld(100, "http-request")
    report = internal_pb2.ServerStatus(
        engine_statuses=[internal_pb2.ServerStatus.EngineStatusWithTenantID(engine_status=status, tenant_id="t")]
    )
    assert internal_pb2.ServerStatus.FromString(encode(report)).engine_statuses[0].engine_status == status


def test_task_result_http_response_arm():
    result = worker_pb2.TaskResult(
        task_id="t1",
        http_response=worker_pb2.HttpResponse(
            status_code=200,
            status="200 OK",
            header={"Content-Type": worker_pb2.HeaderValue(values=["application/json"])},
            body=b"{}",
            latency_ms=7,
        ),
        result_index=0,
    )
    header_entry = ld(1, "Content-Type") + ld(2, ld(1, "application/json"))
    http = uint(1, 200) + ld(2, "200 OK") + ld(3, header_entry) + ld(4, b"{}") + uint(5, 7)
    assert encode(result) == ld(1, "t1") + ld(2, http)
    wrapped = worker_pb2.ProcessTasksRequest(task_result=result)
    assert encode(wrapped) == ld(2, ld(1, "t1") + ld(2, http))


def test_task_result_server_sent_event_arm():
    result = worker_pb2.TaskResult(
        task_id="t1",
        server_sent_event=worker_pb2.ServerSentEvent(data=b'{"x":1}', is_last_event=True, latency_ms=3),
        result_index=5,
    )
    event = ld(1, b'{"x":1}') + boolean(2) + uint(3, 3)
    assert encode(result) == ld(1, "t1") + ld(3, event) + uint(4, 5)


def test_engine_status_with_models():
    status = status_pb2.EngineStatus(
        engine_id="e1",
        ready=True,
        models=[
            status_pb2.EngineStatus.Model(
                id="llama",
                is_ready=True,
                in_progress_task_count=2,
                gpu_allocated=1,
                is_dynamically_loaded_lora=True,
                status_details=status_pb2.EngineStatus.Model.StatusDetails(
                    num_ready_pods=1, num_total_pods=2, status_message="loading"
                ),
            )
        ],
        cluster_id="c1",
    )
    details = uint(1, 1) + uint(2, 2) + ld(3, "loading")
    model = ld(1, "llama") + boolean(2) + uint(3, 2) + uint(4, 1) + boolean(5) + ld(6, details)
    expected = ld(1, "e1") + boolean(4) + ld(5, model) + ld(6, "c1")
    assert encode(status) == expected
    assert encode(worker_pb2.ProcessTasksRequest(engine_status=status)) == ld(1, expected)


def test_prefix_tip_is_an_infx_extension_at_field_105_of_task_request():
    message = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="m"),
                                     infx_prefix_tip=0x0102030405060708)
    # fixed64: tag 105 with wire type 1, then eight little-endian bytes.
    assert encode(message) == ld(1, ld(2, "m")) + tag(105, I64) + bytes(range(8, 0, -1))
    assert encode(worker_pb2.TaskRequest(infx_prefix_tip=0)) == b""  # 0 is "none": nothing on the wire


def test_caller_is_an_infx_extension_at_field_106_of_task_request():
    caller = worker_pb2.Caller(flow="key-1", weight=2.0, criticality=worker_pb2.Caller.CRITICALITY_SHEDDABLE)
    # flow: string 1; weight: double 2 (wire type 1, eight little-endian bytes); criticality: enum 3.
    body = ld(1, "key-1") + double(2, 2.0) + uint(3, 2)
    assert encode(worker_pb2.TaskRequest(infx_caller=caller)) == ld(106, body)
    assert encode(worker_pb2.TaskRequest()) == b""  # no caller: nothing on the wire


def test_model_prefix_tips_are_an_infx_extension_at_field_106_packed():
    model = status_pb2.EngineStatus.Model(id="m", infx_prefix_tips=[1, 2**64 - 1])
    packed = (1).to_bytes(8, "little") + (2**64 - 1).to_bytes(8, "little")
    assert encode(model) == ld(1, "m") + ld(106, packed)


def test_model_runtime_load_is_an_infx_extension_at_field_105():
    load = status_pb2.EngineStatus.RuntimeLoad(
        running_requests=3, waiting_requests=1, kv_cache_usage=0.5, prefix_cache_hit_rate=0.25,
        loaded_adapters=["sql-lora"], source="vllm",
    )
    model = status_pb2.EngineStatus.Model(id="llama", runtime_load=load)
    load_bytes = uint(1, 3) + uint(2, 1) + double(3, 0.5) + double(4, 0.25) + ld(5, "sql-lora") + ld(6, "vllm")
    assert encode(model) == ld(1, "llama") + ld(105, load_bytes)
    # Presence is carried: an explicit 0.0 KV usage is not "not reported".
    idle = status_pb2.EngineStatus.RuntimeLoad(kv_cache_usage=0.0)
    assert encode(idle) == double(3, 0.0)
    assert idle.HasField("kv_cache_usage") and not idle.HasField("prefix_cache_hit_rate")


def test_server_status_and_internal_request():
    status = internal_pb2.ServerStatus(
        pod_name="gw-0",
        engine_statuses=[
            internal_pb2.ServerStatus.EngineStatusWithTenantID(
                engine_status=status_pb2.EngineStatus(engine_id="e1", ready=True), tenant_id="t"
            )
        ],
    )
    expected = ld(1, "gw-0") + ld(4, ld(2, ld(1, "e1") + boolean(4)) + ld(3, "t"))
    assert encode(status) == expected
    assert encode(internal_pb2.ProcessTasksInternalRequest(server_status=status)) == ld(1, expected)
    result = worker_pb2.TaskResult(task_id="x", result_index=1)
    assert encode(internal_pb2.ProcessTasksInternalRequest(task_result=result)) == ld(
        2, ld(1, "x") + uint(4, 1)
    )


def test_server_status_request_counts_are_an_infx_extension_at_field_100():
    status = internal_pb2.ServerStatus(pod_name="gw-0", model_requests_started={"b": 300, "a": 3})
    # tag for field 100, wire type 2 is the varint 802 = a2 06; a map entry is key = 1, value = 2
    assert ld(100, b"")[:2] == b"\xa2\x06"
    expected = ld(1, "gw-0") + ld(100, ld(1, "a") + uint(2, 3)) + ld(100, ld(1, "b") + uint(2, 300))
    assert encode(status) == expected
    assert encode(internal_pb2.ProcessTasksInternalRequest(server_status=status)) == ld(1, expected)


def test_server_status_draining_is_an_infx_extension_at_field_101():
    status = internal_pb2.ServerStatus(pod_name="gw-0", draining=True)
    # tag for field 101, wire type 0 is the varint 808 = a8 06
    assert boolean(101) == b"\xa8\x06\x01"
    assert encode(status) == ld(1, "gw-0") + boolean(101)
    assert not internal_pb2.ServerStatus.FromString(ld(1, "gw-0")).draining


def test_server_status_delta_removed_engines_and_sequence_are_infx_extensions_at_102_to_104():
    status = internal_pb2.ServerStatus(
        pod_name="gw-0",
        engine_statuses=[internal_pb2.ServerStatus.EngineStatusWithTenantID(
            engine_status=status_pb2.EngineStatus(engine_id="e2", ready=True), tenant_id="t")],
        delta=True,
        removed_engines=[internal_pb2.ServerStatus.RemovedEngine(engine_id="e3", tenant_id="t")],
        sequence=300,
    )
    # tags: 102 varint = b0 06, 103 length-delimited = ba 06, 104 varint = c0 06
    assert boolean(102)[:2] == b"\xb0\x06" and ld(103, b"")[:2] == b"\xba\x06" and uint(104, 0)[:2] == b"\xc0\x06"
    expected = (ld(1, "gw-0") + ld(4, ld(2, ld(1, "e2") + boolean(4)) + ld(3, "t"))
                + boolean(102) + ld(103, ld(1, "e3") + ld(2, "t")) + uint(104, 300))
    assert encode(status) == expected
    # A full report of LLMariner's shape parses as an unnumbered full snapshot.
    old = internal_pb2.ServerStatus.FromString(ld(1, "gw-0"))
    assert not old.delta and not old.removed_engines and old.sequence == 0


def test_a_llmariner_peer_reads_a_server_status_with_counts_and_skips_them():
    """A ServerStatus without field 100 (LLMariner's) parses infx's report, skipping the counts."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="llmariner_internal.proto", package="llmariner_compat",
                                              syntax="proto3")
    message = file.message_type.add(name="ServerStatus")
    message.field.add(name="pod_name", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    llmariner_status = message_factory.GetMessageClass(pool.FindMessageTypeByName("llmariner_compat.ServerStatus"))
    sent = internal_pb2.ServerStatus(pod_name="gw-0", model_requests_started={"a": 3}, draining=True, sequence=7)
    parsed = llmariner_status.FromString(encode(sent))
    assert parsed.pod_name == "gw-0"
    # Old reports (no field 100) parse here with no counts.
    assert dict(internal_pb2.ServerStatus.FromString(ld(1, "gw-0")).model_requests_started) == {}


def test_process_tasks_internal_response_and_worker_response():
    task = worker_pb2.Task(id="t1", engine_id="e1")
    task_bytes = ld(1, "t1") + ld(5, "e1")
    message = internal_pb2.ProcessTasksInternalResponse(new_task=task, tenant_id="tenant-a")
    assert encode(message) == ld(1, task_bytes) + ld(2, "tenant-a")
    assert encode(worker_pb2.ProcessTasksResponse(new_task=task)) == ld(1, task_bytes)


def test_chat_completion_request():
    Req = chat_pb2.CreateChatCompletionRequest
    Msg = chat_pb2.ChatCompletionMessage
    request = Req(
        messages=[
            Msg(
                role="user",
                name="n",
                content=[
                    Msg.Content(type="text", text="hi"),
                    Msg.Content(type="image_url", image_url=Msg.Content.ImageUrl(url="u", detail="low")),
                ],
                tool_calls=[Msg.ToolCall(id="c", type="function", function=Msg.ToolCall.Function(name="f", arguments="{}"))],
                tool_call_id="tc",
            )
        ],
        model="llama",
        frequency_penalty=0.5,
        logprobs=True,
        top_logprobs=2,
        max_tokens=10,
        n=1,
        presence_penalty=0.25,
        response_format=Req.ResponseFormat(
            type="json_schema",
            json_schema=Req.ResponseFormat.JsonSchema(name="s", description="d", encoded_schema="e30=", strict=True),
        ),
        seed=42,
        stop=["\n"],
        stream=True,
        temperature=0.0,
        top_p=0.9,
        tools=[Req.Tool(type="function", function=Req.Tool.Function(description="d", name="f", encoded_parameters="e30="))],
        tool_choice="auto",
        user="u",
        stream_options=Req.StreamOptions(include_usage=True),
        tool_choice_object=Req.ToolChoice(type="function", function=Req.ToolChoice.Function(name="f")),
        max_completion_tokens=20,
        encoded_chat_template_kwargs="e30=",
        is_temperature_set=True,
        is_top_p_set=True,
    )
    message = (
        ld(2, "user")
        + ld(3, "n")
        + ld(4, ld(1, "c") + ld(2, "function") + ld(3, ld(1, "f") + ld(2, "{}")))
        + ld(5, ld(1, "text") + ld(2, "hi"))
        + ld(5, ld(1, "image_url") + ld(3, ld(1, "u") + ld(2, "low")))
        + ld(6, "tc")
    )
    expected = (
        ld(1, message)
        + ld(2, "llama")
        + double(3, 0.5)
        + boolean(5)
        + uint(6, 2)
        + uint(7, 10)
        + uint(8, 1)
        + double(9, 0.25)
        + ld(10, ld(1, "json_schema") + ld(2, ld(1, "s") + ld(2, "d") + ld(3, "e30=") + boolean(4)))
        + uint(11, 42)
        + ld(12, "\n")
        + boolean(13)
        # temperature 0.0 is proto3's default and is not written: hence is_temperature_set.
        + double(15, 0.9)
        + ld(16, ld(1, "function") + ld(2, ld(1, "d") + ld(2, "f") + ld(3, "e30=")))
        + ld(17, "auto")
        + ld(18, "u")
        + ld(19, boolean(1))
        + ld(20, ld(2, "function") + ld(3, ld(1, "f")))
        + uint(21, 20)
        + ld(22, "e30=")
        + boolean(23)
        + boolean(24)
    )
    assert encode(request) == expected
    assert encode(worker_pb2.TaskRequest(chat_completion=request)) == ld(1, expected)


def test_chat_logit_bias_map_entry():
    request = chat_pb2.CreateChatCompletionRequest(logit_bias={"50256": -100.0})
    assert encode(request) == ld(4, ld(1, "50256") + double(2, -100.0))
