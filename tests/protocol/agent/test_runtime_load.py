"""The runtime load monitor on a hand-stepped clock: which paths, when to scrape, what to report."""

import json

import pytest

from protocol.agent.runtime_load import (
    LoadChanged,
    LoadConfig,
    LoadSample,
    LoadSource,
    LoadUsageError,
    RuntimeLoad,
    RuntimeLoadMonitor,
    ScrapeAnswer,
    ScrapeRuntime,
)


def vllm(running=0, waiting=0, kv=0.0, hits=0.0, queries=0.0):
    return ScrapeAnswer(200, (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
        f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries}\n'
    ).encode())


def scrape_of(effects):
    [scrape] = [e for e in effects if isinstance(e, ScrapeRuntime)]
    return scrape


def loads(effects):
    return [e.load for e in effects if isinstance(e, LoadChanged)]


class Driver:
    """Steps a monitor: answers each scrape with what ``answer(path)`` gives."""

    def __init__(self, config=None):
        self.monitor = RuntimeLoadMonitor(config or LoadConfig(report_min_interval=2.0))
        self.now = 0.0
        self.scrape = scrape_of(self.monitor.start(self.now))

    def answer(self, sample=None, **by_path):
        answers = {path: by_path[path.strip("/")] for path in self.scrape.paths if path.strip("/") in by_path}
        effects = self.monitor.scrape_done(self.scrape.scrape_id, answers, sample, self.now)
        self.scrape = None
        return effects

    def tick(self, to):
        self.now = to
        effects = self.monitor.handle_timeout(self.now)
        scrapes = [e for e in effects if isinstance(e, ScrapeRuntime)]
        if scrapes:
            self.scrape = scrapes[0]
        return effects


def test_the_first_reading_is_reported_at_once_with_the_wire_shape():
    d = Driver()
    assert d.scrape.paths == ("/metrics", "/slots")
    [load] = loads(d.answer(metrics=vllm(running=3, waiting=1, kv=0.5), slots=ScrapeAnswer(404)))
    assert load == RuntimeLoad("vllm", 3, 1, kv_cache_usage=0.5)
    pb = load.to_pb()
    assert (pb.running_requests, pb.waiting_requests, pb.source) == (3, 1, "vllm")
    assert pb.HasField("kv_cache_usage") and not pb.HasField("prefix_cache_hit_rate")
    assert d.monitor.source is LoadSource.METRICS


def test_scrapes_repeat_every_interval():
    d = Driver()
    d.answer(metrics=vllm())
    assert d.monitor.next_deadline() == 1.0
    assert d.tick(0.99) == []
    assert d.tick(1.0)[0] == ScrapeRuntime(2, ("/metrics",))


def test_changes_are_coalesced_to_one_report_per_min_interval():
    d = Driver(LoadConfig(report_min_interval=3.0))
    d.answer(metrics=vllm(running=1))
    d.tick(1.0)
    assert loads(d.answer(metrics=vllm(running=2))) == []  # too soon after the first report
    d.tick(2.0)
    assert loads(d.answer(metrics=vllm(running=4))) == []
    assert d.monitor.next_deadline() == 3.0
    [load] = loads(d.tick(3.0))  # the held-back report carries the newest reading
    assert load.running == 4


def test_small_changes_of_a_busy_runtime_are_not_reported():
    d = Driver()
    d.answer(metrics=vllm(running=40, kv=0.50))
    for step, running in enumerate([42, 38, 43, 37], start=1):
        d.tick(step * 3.0)
        assert loads(d.answer(metrics=vllm(running=running, kv=0.52))) == []
    d.tick(15.0)
    [load] = loads(d.answer(metrics=vllm(running=44, kv=0.52)))  # 10 % of 40 moved
    assert load.running == 44
    d.tick(18.0)
    [load] = loads(d.answer(metrics=vllm(running=44, kv=0.6)))  # KV use moved by 0.05 or more
    assert load.kv_cache_usage == 0.6


def test_a_change_that_reverts_before_its_report_is_due_is_not_sent():
    d = Driver(LoadConfig(report_min_interval=3.0))
    d.answer(metrics=vllm(running=1))
    d.tick(1.0)
    d.answer(metrics=vllm(running=5))
    d.tick(2.0)
    d.answer(metrics=vllm(running=1))
    assert loads(d.tick(3.0)) == []


def test_hit_rate_is_the_counters_increase_over_the_window():
    d = Driver(LoadConfig(report_min_interval=0.0, hit_rate_window=10.0))
    [first] = loads(d.answer(metrics=vllm(hits=1000, queries=10_000)))
    assert first.prefix_cache_hit_rate is None  # one point makes no rate
    d.tick(5.0)
    [load] = loads(d.answer(metrics=vllm(hits=1800, queries=11_000)))
    assert load.prefix_cache_hit_rate == pytest.approx(0.8)
    d.tick(20.0)  # the first points left the window; the increase since 5 s is all hits
    [load] = loads(d.answer(metrics=vllm(hits=2800, queries=12_000)))
    assert load.prefix_cache_hit_rate == pytest.approx(1.0)
    d.tick(40.0)  # no query since: the last rate stands
    assert loads(d.answer(metrics=vllm(hits=2800, queries=12_000))) == []
    assert d.monitor.reported.prefix_cache_hit_rate == pytest.approx(1.0)


def test_counters_that_go_down_start_the_history_over():
    d = Driver(LoadConfig(report_min_interval=0.0))
    d.answer(metrics=vllm(hits=900, queries=1000))
    d.tick(1.0)
    d.answer(metrics=vllm(hits=950, queries=1100))  # 0.5
    d.tick(2.0)
    assert loads(d.answer(metrics=vllm(hits=0, queries=10))) == []  # restarted: no new rate yet
    d.tick(3.0)
    [load] = loads(d.answer(metrics=vllm(hits=10, queries=20)))
    assert load.prefix_cache_hit_rate == pytest.approx(1.0)


def test_load_is_withdrawn_after_stale_after_failed_scrapes():
    d = Driver(LoadConfig(stale_after=3))
    d.answer(metrics=vllm(running=2))
    d.tick(1.0)
    assert d.answer() == []  # connection failed
    d.tick(2.0)
    assert d.answer(metrics=ScrapeAnswer(500, b"oops")) == []
    d.tick(3.0)
    assert loads(d.answer(metrics=ScrapeAnswer(None))) == [None]
    d.tick(4.0)
    [load] = loads(d.answer(metrics=vllm(running=2)))
    assert load.running == 2


def test_a_scrape_that_takes_too_long_is_abandoned_and_its_late_answer_ignored():
    d = Driver(LoadConfig(timeout=2.0, stale_after=1))
    d.answer(metrics=vllm(running=2))
    d.tick(1.0)
    late = d.scrape
    assert d.monitor.next_deadline() == 3.0
    assert loads(d.tick(3.0)) == [None]
    assert d.monitor.scrape_done(late.scrape_id, {"/metrics": vllm(running=9)}, None, 3.5) == []
    assert d.monitor.next_deadline() == 4.0


def test_a_runtime_with_neither_metrics_nor_slots_reports_nothing_and_is_asked_again_rarely():
    d = Driver(LoadConfig(absent_interval=30.0))
    assert d.answer(metrics=ScrapeAnswer(404, b"Not Found"), slots=ScrapeAnswer(404)) == []
    assert d.monitor.source is LoadSource.ABSENT
    assert d.monitor.next_deadline() == 30.0
    d.tick(30.0)
    assert d.scrape.paths == ("/metrics", "/slots") and d.monitor.source is LoadSource.PROBING


def test_a_probe_that_fails_tells_nothing_and_is_asked_again():
    d = Driver()
    assert d.answer() == [] and d.monitor.source is LoadSource.PROBING
    d.tick(1.0)
    assert d.scrape.paths == ("/metrics", "/slots")
    assert d.answer(slots=ScrapeAnswer(404)) == [] and d.monitor.source is LoadSource.PROBING


def test_a_runtime_that_turns_ready_is_read_at_once_and_its_slots_reported():
    d = Driver(LoadConfig(interval=1.0, report_min_interval=2.0))
    d.now = 0.3
    assert d.answer() == []  # still starting: no answer
    assert d.monitor.next_deadline() == 1.3
    d.now = 0.5
    d.scrape = scrape_of(d.monitor.runtime_ready(d.now))
    assert d.scrape.paths == ("/metrics", "/slots")
    assert d.monitor.runtime_ready(d.now) == [], "a scrape under way stands"
    [load] = loads(d.answer(slots=slots((1, 10, 0), (2, 10, 0))))
    assert load.slots == 2


def test_a_runtime_that_showed_no_load_is_probed_again_when_it_turns_ready():
    d = Driver(LoadConfig(absent_interval=30.0))
    d.answer(metrics=ScrapeAnswer(404), slots=ScrapeAnswer(404))
    assert d.monitor.source is LoadSource.ABSENT
    d.now = 2.0
    assert scrape_of(d.monitor.runtime_ready(d.now)).paths == ("/metrics", "/slots")
    assert d.monitor.source is LoadSource.PROBING


def test_before_start_readiness_asks_for_no_scrape():
    assert RuntimeLoadMonitor(LoadConfig()).runtime_ready(0.0) == []


def slots(*tasks, processing=0):
    body = [{"id": i, "is_processing": i < processing, "id_task": t, "n_prompt_tokens": p,
             "n_prompt_tokens_cache": c} for i, (t, p, c) in enumerate(tasks)]
    return ScrapeAnswer(200, json.dumps(body).encode())


def test_llamacpp_metrics_bring_in_slots_and_the_hit_rate_counts_each_task_once():
    d = Driver(LoadConfig(report_min_interval=0.0))
    [load] = loads(d.answer(metrics=ScrapeAnswer(200, b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n")))
    assert (load.source, load.running, load.waiting) == ("llama.cpp", 1, 2)
    d.tick(1.0)
    assert d.scrape.paths == ("/metrics", "/slots")
    metrics = ScrapeAnswer(200, b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n")
    d.answer(metrics=metrics, slots=slots((7, 100, 0), (8, 100, 50), processing=1))
    d.tick(2.0)  # the same tasks again: nothing new counted; then task 9 on slot 0 hit 90 of 100
    d.answer(metrics=metrics, slots=slots((7, 100, 0), (8, 100, 50), processing=1))
    d.tick(3.0)
    [load] = loads(d.answer(metrics=metrics, slots=slots((9, 100, 90), (8, 100, 50), processing=1)))
    assert load.prefix_cache_hit_rate == pytest.approx(0.9)


def test_llamacpps_own_cache_counters_give_the_hit_rate_rather_than_its_slots():
    """Counters see every task; the slots only those running when scraped."""
    d = Driver(LoadConfig(report_min_interval=0.0))

    def metrics(cached, computed):
        return ScrapeAnswer(200, (f"llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n"
                                  f"llamacpp:prompt_tokens_cached_total {cached}\n"
                                  f"llamacpp:prompt_tokens_total {computed}\n").encode())

    d.answer(metrics=metrics(0, 0))
    d.tick(1.0)
    d.answer(metrics=metrics(100, 300), slots=slots((7, 100, 0), processing=1))
    d.tick(2.0)
    [load] = loads(d.answer(metrics=metrics(400, 400), slots=slots((7, 100, 0), processing=1)))
    assert load.prefix_cache_hit_rate == pytest.approx(0.5)


def test_llamacpp_without_metrics_is_read_from_its_slots_alone():
    d = Driver(LoadConfig(report_min_interval=0.0))
    d.answer(metrics=ScrapeAnswer(501, b"This server does not support metrics endpoint."))
    d.tick(1.0)
    [load] = loads(d.answer(slots=slots((1, 10, 0), processing=1)))
    assert (load.source, load.running, load.waiting) == ("llama.cpp", 1, 0)
    assert d.monitor.source is LoadSource.SLOTS


def test_malformed_metrics_count_as_a_failed_scrape():
    d = Driver(LoadConfig(stale_after=1))
    d.answer(metrics=vllm(running=1))
    d.tick(1.0)
    assert loads(d.answer(metrics=ScrapeAnswer(200, b"vllm:num_requests_running{ 1\n"))) == [None]


def test_start_twice_and_bad_config_are_usage_errors():
    m = RuntimeLoadMonitor()
    m.start(0.0)
    with pytest.raises(LoadUsageError):
        m.start(0.0)
    with pytest.raises(LoadUsageError):
        LoadConfig(interval=0)
    with pytest.raises(LoadUsageError):
        LoadConfig(stale_after=0)


LLAMACPP_IDLE = ScrapeAnswer(200, b"llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n")


def test_llamacpps_slots_are_the_entries_of_its_slots_list():
    d = Driver(LoadConfig(report_min_interval=0.0))
    [load] = loads(d.answer(metrics=LLAMACPP_IDLE))
    assert load.slots is None  # /metrics alone does not say
    d.tick(1.0)
    [load] = loads(d.answer(metrics=LLAMACPP_IDLE, slots=slots((1, 10, 0), (2, 10, 0), (3, 10, 0))))
    assert load.slots == 3
    assert load.to_pb() == RuntimeLoad("llama.cpp", 0, 0).to_pb()  # the slots go out beside the load, not in it


def test_a_llamacpp_servers_first_reading_says_its_slots_and_a_change_of_them_is_not_held_back():
    """Its capacity: until the gateway has it, a fresh engine is routed as one that reports no slots."""
    d = Driver(LoadConfig(report_min_interval=2.0))
    [load] = loads(d.answer(metrics=LLAMACPP_IDLE, slots=slots((1, 10, 0), (2, 10, 0))))
    assert (load.source, load.slots) == ("llama.cpp", 2) and d.monitor.source is LoadSource.METRICS_AND_SLOTS
    d.tick(1.0)
    [load] = loads(d.answer(metrics=LLAMACPP_IDLE, slots=slots((1, 10, 0), (2, 10, 0), (3, 10, 0))))
    assert load.slots == 3  # within report_min_interval of the first report, sent all the same
    d.tick(2.0)
    busy = ScrapeAnswer(200, b"llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n")
    assert loads(d.answer(metrics=busy, slots=slots((1, 10, 0), (2, 10, 0), (3, 10, 0), processing=2))) == []


def test_a_llamacpp_server_with_slots_off_is_asked_its_props_once():
    d = Driver(LoadConfig(report_min_interval=0.0))
    d.answer(metrics=LLAMACPP_IDLE)
    d.tick(1.0)
    d.answer(metrics=LLAMACPP_IDLE, slots=ScrapeAnswer(501, b"This server does not support slots endpoint."))
    assert d.monitor.source is LoadSource.METRICS
    d.tick(2.0)
    assert d.scrape.paths == ("/metrics", "/props")
    [load] = loads(d.answer(metrics=LLAMACPP_IDLE, props=ScrapeAnswer(200, b'{"total_slots": 4, "x": 1}')))
    assert load.slots == 4
    d.tick(3.0)
    assert d.scrape.paths == ("/metrics",)
    assert loads(d.answer(metrics=LLAMACPP_IDLE)) == []  # still 4 slots: nothing changed


def test_a_vllm_server_is_never_asked_for_props():
    d = Driver(LoadConfig(report_min_interval=0.0))
    d.answer(metrics=vllm())
    for at in (1.0, 2.0):
        d.tick(at)
        assert d.scrape.paths == ("/metrics",)
        d.answer(metrics=vllm())


def test_a_reading_carries_the_stamp_of_its_scrape_and_a_new_stamp_alone_is_no_change():
    """The gateway counts its tasks after the stamp it holds; an equal load with a newer stamp says nothing
    more, and a changed load goes out with the stamp of the scrape that read it."""
    d = Driver(LoadConfig(report_min_interval=0.0))
    [load] = loads(d.answer(LoadSample(1, 5, 3), metrics=vllm(running=2)))
    assert load.sample == LoadSample(1, 5, 3)
    d.tick(1.0)
    assert loads(d.answer(LoadSample(1, 9, 7), metrics=vllm(running=2))) == []
    assert d.monitor.reported.sample == LoadSample(1, 5, 3)
    d.tick(2.0)
    [load] = loads(d.answer(LoadSample(1, 12, 8), metrics=vllm(running=4)))
    assert load.sample == LoadSample(1, 12, 8)


def test_a_held_back_report_goes_out_with_the_stamp_of_the_reading_it_reports():
    d = Driver(LoadConfig(report_min_interval=2.0))
    d.answer(LoadSample(1, 1, 0), metrics=vllm(running=1))
    d.tick(1.0)
    assert loads(d.answer(LoadSample(1, 4, 1), metrics=vllm(running=3))) == []  # held back to t=2
    [load] = loads(d.tick(2.0))
    assert (load.running, load.sample) == (3, LoadSample(1, 4, 1))


def test_an_equal_load_stamped_on_another_stream_or_first_stamped_is_reported():
    """A stamp counts one stream's tasks: a reading taken before the stream opened (no stamp), or on a
    stream since replaced, tells the gateway of the current stream nothing it can subtract."""
    d = Driver(LoadConfig(report_min_interval=0.0))
    [load] = loads(d.answer(None, metrics=vllm(running=2)))
    assert load.sample is None
    d.tick(1.0)
    [load] = loads(d.answer(LoadSample(1, 0, 0), metrics=vllm(running=2)))
    assert load.sample == LoadSample(1, 0, 0)
    d.tick(2.0)
    [load] = loads(d.answer(LoadSample(2, 0, 0), metrics=vllm(running=2)))
    assert load.sample == LoadSample(2, 0, 0)
    d.tick(3.0)
    assert loads(d.answer(LoadSample(2, 3, 1), metrics=vllm(running=2))) == []
