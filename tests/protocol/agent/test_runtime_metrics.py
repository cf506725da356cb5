"""Parsers of the runtimes' own load signals (vLLM, llama.cpp, SGLang), on bodies shaped like theirs."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.agent.runtime_load import RuntimeLoad
from protocol.agent.runtime_metrics import (
    WANTED,
    MetricsFormatError,
    SlotTask,
    parse_exposition,
    parse_slots,
    reading_from_metrics,
    reading_from_slots,
    total_slots_from_props,
)

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 500.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 700.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="x"} 1.7000001e+09
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 17.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.125
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.75
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
"""


def test_vllm_v1_sums_data_parallel_engines_and_takes_the_fullest_kv_cache():
    reading = reading_from_metrics(VLLM_V1)
    assert reading is not None
    assert (reading.source, reading.running, reading.waiting) == ("vllm", 5, 4)
    assert reading.kv_cache_usage == 0.5
    assert (reading.prefix_hits, reading.prefix_queries) == (1200.0, 2000.0)
    assert reading.prefix_hit_rate is None


def test_vllm_lora_adapters_come_from_the_newest_lora_requests_info_sample():
    reading = reading_from_metrics(VLLM_V1)
    assert reading is not None and reading.adapters == ("chat-lora", "sql-lora")


def test_older_vllm_names_are_read_too():
    reading = reading_from_metrics(VLLM_OLD)
    assert reading is not None
    assert (reading.running, reading.kv_cache_usage, reading.prefix_hit_rate) == (1, 0.125, 0.75)


def test_llamacpp_metrics_give_processing_and_deferred_requests():
    reading = reading_from_metrics(LLAMACPP)
    assert reading is not None
    assert (reading.source, reading.running, reading.waiting, reading.kv_cache_usage) == ("llama.cpp", 2, 5, None)


def test_sglang_metrics_give_its_own_hit_rate_and_token_usage():
    reading = reading_from_metrics(SGLANG)
    assert reading is not None
    assert (reading.source, reading.running, reading.waiting) == ("sglang", 7, 3)
    assert reading.kv_cache_usage == 0.28 and reading.prefix_hit_rate == pytest.approx(0.0075, abs=1e-4)


def test_a_body_of_other_metrics_says_nothing():
    assert reading_from_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.5\n") is None
    assert reading_from_metrics("") is None


def test_absurd_counts_are_capped_to_what_the_wire_carries():
    reading = reading_from_metrics("vllm:num_requests_running 1e300\nvllm:num_requests_waiting -5\n")
    assert reading is not None and (reading.running, reading.waiting) == (2**31 - 1, 0)
    RuntimeLoad(reading.source, reading.running, reading.waiting).to_pb()


def test_fractions_outside_zero_to_one_are_clamped_and_nan_is_ignored():
    reading = reading_from_metrics("vllm:kv_cache_usage_perc 1.5\nvllm:num_requests_running NaN\n")
    assert reading is not None and reading.kv_cache_usage == 1.0 and reading.running == 0


@pytest.mark.parametrize("line", [
    'vllm:num_requests_running{model_name="m" 1',
    "vllm:num_requests_running",
    "vllm:num_requests_running one",
    'vllm:num_requests_running{model_name=m} 1',
])
def test_a_malformed_line_of_a_wanted_series_is_a_format_error(line):
    with pytest.raises(MetricsFormatError):
        parse_exposition(line)


def test_malformed_lines_of_series_nobody_reads_are_skipped():
    assert parse_exposition("garbage{{{ here\nvllm:num_requests_waiting 2 1700000000000\n")[0].value == 2.0


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_label_values_with_escapes_read_back_as_written(value):
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    [sample] = parse_exposition(f'vllm:lora_requests_info{{running_lora_adapters="{escaped}",max_lora="1"}} 1\n')
    assert sample.label("running_lora_adapters") == value and sample.label("max_lora") == "1"


def _slot(slot_id, processing, task=None, prompt=None, cached=None):
    slot = {"id": slot_id, "n_ctx": 4096, "speculative": False, "is_processing": processing}
    if task is not None:
        slot.update(id_task=task, n_prompt_tokens=prompt, n_prompt_tokens_cache=cached, params={})
    return slot


def test_llamacpp_slots_count_what_runs_and_keep_each_running_slots_cache_use():
    body = json.dumps([_slot(0, True, 12, 100, 80), _slot(1, False, 9, 50, 0), _slot(2, False)]).encode()
    processing, tasks = parse_slots(body)
    assert processing == 1
    assert tasks == (SlotTask(0, 12, 100, 80),)


def test_slots_merge_with_the_metrics_deferred_count():
    body = json.dumps([_slot(0, True, 1, 10, 5)]).encode()
    reading = reading_from_slots(body, reading_from_metrics(LLAMACPP))
    assert (reading.running, reading.waiting, reading.slot_tasks) == (1, 5, (SlotTask(0, 1, 10, 5),))
    assert reading_from_slots(body, None).waiting == 0


@pytest.mark.parametrize("body", [b"not json", b'{"id": 0}', b'[{"id": 0}]', b'[{"id": "0", "is_processing": true}]'])
def test_slots_that_are_not_llamacpp_slots_are_a_format_error(body):
    with pytest.raises(MetricsFormatError):
        parse_slots(body)


_line = st.tuples(
    st.sampled_from(sorted(WANTED) + ["other_metric", "# HELP x"]),
    st.text(alphabet=st.sampled_from(list('{}="\\,ab 0123456789.e+-\tNaInf')), max_size=40),
).map("".join)


@given(st.lists(_line, max_size=8).map("\n".join))
def test_any_body_is_a_reading_none_or_a_format_error(text):
    try:
        reading = reading_from_metrics(text)
    except MetricsFormatError:
        return
    assert reading is None or (0 <= reading.running < 2**31 and 0 <= reading.waiting < 2**31)
    if reading is not None and reading.kv_cache_usage is not None:
        assert 0.0 <= reading.kv_cache_usage <= 1.0


@given(st.binary(max_size=200))
def test_any_slots_body_is_read_or_a_format_error(body):
    try:
        processing, tasks = parse_slots(body)
    except MetricsFormatError:
        return
    assert processing >= 0 and all(0 <= t.cached_tokens <= t.prompt_tokens for t in tasks)


# --- llama-server itself (llama-cpp-python 0.3.36's vendored llama.cpp), bodies scraped from a live server ---
# Two slots busy and two requests deferred; one slot's prompt shared 500 tokens with the slot's cache.
# See harness/llama_server.py for what each field means.

DATA = Path(__file__).resolve().parent / "data"


def test_a_live_llama_server_scrape_gives_its_counts_and_its_own_prefix_cache_counters():
    reading = reading_from_metrics((DATA / "llama_server_metrics_busy.txt").read_text())
    assert (reading.source, reading.running, reading.waiting, reading.kv_cache_usage) == ("llama.cpp", 2, 2, None)
    # prompt_tokens_total counts computed tokens only, so the queries are computed + cached.
    assert (reading.prefix_hits, reading.prefix_queries) == (500, 2800)


def test_llamacpp_without_the_cached_counter_gives_no_prefix_counters():
    """Older builds export prompt_tokens_total alone: no hit rate can be made of it."""
    reading = reading_from_metrics(LLAMACPP)
    assert (reading.prefix_hits, reading.prefix_queries) == (None, None)


def test_live_busy_slots_give_each_tasks_prompt_as_cached_plus_computed():
    """While generating, n_prompt_tokens also counts the tokens generated so far."""
    processing, tasks = parse_slots((DATA / "llama_server_slots_busy.json").read_bytes())
    assert processing == 2
    assert tasks == (SlotTask(0, 44, 1100, 0), SlotTask(1, 42, 1100, 500))


def test_idle_slots_keep_their_last_task_id_but_not_its_statistics_so_they_count_no_task():
    """llama-server zeroes a slot's statistics when its task ends: a hit rate read from them would
    count every finished task as a full miss."""
    body = (DATA / "llama_server_slots_idle.json").read_bytes()
    assert all(slot["id_task"] > 0 and slot["n_prompt_tokens_cache"] == 0 for slot in json.loads(body))
    assert parse_slots(body) == (0, ())


def test_slots_carry_the_metrics_prefix_counters():
    metrics = reading_from_metrics((DATA / "llama_server_metrics_busy.txt").read_text())
    reading = reading_from_slots((DATA / "llama_server_slots_busy.json").read_bytes(), metrics)
    assert (reading.running, reading.waiting, reading.prefix_hits, reading.prefix_queries) == (2, 2, 500, 2800)


def test_llamacpps_slots_list_says_how_many_slots_it_has_busy_or_not():
    busy = reading_from_slots((DATA / "llama_server_slots_busy.json").read_bytes(), None)
    idle = reading_from_slots((DATA / "llama_server_slots_idle.json").read_bytes(), None)
    assert busy.slots == len(json.loads((DATA / "llama_server_slots_busy.json").read_bytes()))
    assert idle.slots == len(json.loads((DATA / "llama_server_slots_idle.json").read_bytes())) and idle.running == 0


def test_props_give_total_slots_and_nothing_else_is_taken_for_them():
    assert total_slots_from_props(b'{"total_slots": 2, "model_alias": "tiny"}') == 2
    assert total_slots_from_props(b'{"total_slots": 0}') is None
    assert total_slots_from_props(b'{"total_slots": true}') is None
    assert total_slots_from_props(b"[]") is None
    with pytest.raises(MetricsFormatError):
        total_slots_from_props(b"<html>")
