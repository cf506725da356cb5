"""The modelled llama-server (harness/sim/routing/llama.py): slots chosen as the server chooses them, the
prompt reused as it reuses it, the host prompt cache kept as it keeps it, iterations timed by its costs.
The same requests on the real server are tests/bench/test_real_routing.py's calibration."""

from __future__ import annotations

import pytest

from harness.sim.routing.llama import LlamaCosts, LlamaJob, LlamaServerModel, common_prefix

#: One second per iteration and nothing else, so that times count iterations.
TICKS = LlamaCosts(iteration=1.0, prompt_token=0.0, prompt_token_per_position=0.0, generated_token=0.0,
                   generated_token_per_position=0.0)


def run(server: LlamaServerModel, *jobs: LlamaJob, at: float = 0.0) -> float:
    """Submit ``jobs`` at ``at`` and step the server until it idles; the time it idles at."""
    for job in jobs:
        server.submit(job, at)
    now = at
    while server.busy_until is not None:
        now = server.busy_until
        server.step(now)
    return now


def job(name: str, prompt: list[int], max_tokens: int = 2) -> LlamaJob:
    return LlamaJob(name, prompt, max_tokens)


def test_a_prompt_reuses_what_its_slot_holds_and_computes_one_token_at_least():
    server = LlamaServerModel("e0", slots=1, costs=TICKS)
    first, again, longer = job("a", list(range(100))), job("b", list(range(100))), job("c", list(range(150)))
    run(server, first)
    run(server, again, at=10)
    run(server, longer, at=20)
    assert (first.cache_n, first.prompt_n) == (0, 100)
    assert (again.cache_n, again.prompt_n) == (99, 1)
    assert (longer.cache_n, longer.prompt_n) == (100, 50)
    assert (server.prompt_tokens_cached_total, server.prompt_tokens_total) == (199, 151)


def test_an_idle_slot_is_chosen_by_the_prefix_it_shares_else_the_least_recently_used():
    server = LlamaServerModel("e0", slots=2, cache_ram=None, costs=TICKS)
    a, b = job("a", [1] * 50), job("b", [2] * 50)
    run(server, a)  # both slots empty and never used: the last one (slot 1) by LRU
    run(server, b, at=10)  # slot 0, the least recently used
    again = job("a2", [1] * 50 + [3] * 10)
    run(server, again, at=20)
    assert again.cache_n == 50  # slot 1 still held a's prompt
    other = job("c", [4] * 50)
    run(server, other, at=30)  # nothing shared: LRU, slot 0 (b's), which loses b
    b_again = job("b2", [2] * 50)
    run(server, b_again, at=40)
    assert b_again.cache_n == 0  # without the host cache, b is gone


def test_the_host_cache_restores_a_prompt_both_slots_have_moved_on_from():
    server = LlamaServerModel("e0", slots=2, costs=TICKS)  # the default 8 GiB host cache
    for i, token in enumerate((1, 2, 3, 4)):
        run(server, job(f"p{token}", [token] * 60), at=10 * i)
    back = job("back", [1] * 60 + [9] * 5)
    run(server, back, at=50)
    assert back.cache_n == 60


def test_a_small_host_cache_drops_its_oldest_contexts_first():
    """Room for three 61-token contexts (60 prompt + 1 generated) of 10 bytes a token. A slot saves what it
    holds before it looks for the new prompt, so that save may push out an older context first."""
    server = LlamaServerModel("e0", slots=1, cache_ram=1900, bytes_per_token=10, costs=TICKS)
    for i, token in enumerate((1, 2, 3, 4)):
        run(server, job(f"p{token}", [token] * 60), at=10 * i)
    oldest, kept = job("old", [1] * 60 + [9]), job("kept", [3] * 60 + [9])
    run(server, oldest, at=50)
    run(server, kept, at=60)
    assert (oldest.cache_n, kept.cache_n) == (0, 60)


def test_a_context_larger_than_the_whole_host_cache_is_not_saved():
    server = LlamaServerModel("e0", slots=1, cache_ram=100, bytes_per_token=10, costs=TICKS)
    run(server, job("big", [1] * 60))
    run(server, job("other", [2] * 60), at=10)
    back = job("back", [1] * 60 + [9])
    run(server, back, at=20)
    assert back.cache_n == 0


def test_with_every_slot_busy_a_request_waits_and_the_metrics_say_so():
    server = LlamaServerModel("e0", slots=1, costs=TICKS)
    a, b = job("a", [1] * 10, max_tokens=3), job("b", [2] * 10)
    server.submit(a, 0.0)
    server.submit(b, 0.0)
    server.step(0.0)
    assert (server.processing, server.deferred) == (1, 1)
    assert "llamacpp:requests_processing 1\nllamacpp:requests_deferred 1\n" in server.metrics()
    assert server.slots_body() == [{"id": 0, "is_processing": True, "n_ctx": 4096}]
    now = 0.0
    while server.busy_until is not None:
        now = server.busy_until
        server.step(now)
    # a: its prompt's iteration gives the first token, two more iterations the rest; then b's two.
    assert (a.first_token, a.done, b.first_token, b.done) == (1.0, 3.0, 4.0, 5.0)


def test_an_iteration_costs_more_for_more_prompt_tokens_and_longer_contexts():
    costs = LlamaCosts()
    assert costs.iteration_seconds([(0, 1000)], []) > costs.iteration_seconds([(0, 500)], []) * 2
    assert costs.iteration_seconds([(1000, 1100)], []) > costs.iteration_seconds([(0, 100)], [])
    assert costs.iteration_seconds([], [2000]) > costs.iteration_seconds([], [100])
    assert costs.scaled(2.0).iteration_seconds([(0, 10)], [50]) == pytest.approx(
        2 * costs.iteration_seconds([(0, 10)], [50]))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def test_a_named_slot_waits_for_that_slot_and_a_restored_file_is_reused_as_the_slot_would_be():
    server = LlamaServerModel("e0", slots=2, cache_ram=None, costs=TICKS)
    a = list(range(100))
    run(server, LlamaJob("a", a, 2, slot=0))
    server.save_slot(0, "a.bin")
    run(server, LlamaJob("b", list(range(1000, 1100)), 2, slot=1), at=10)
    pinned = LlamaJob("c", list(range(2000, 2100)), 2, slot=0)
    run(server, pinned, at=20)  # slot 0 named: it loses a's context
    assert not server.restore_slot(1, "missing.bin")
    assert server.restore_slot(1, "a.bin")
    later = LlamaJob("a2", a + [7, 8, 9], 2, slot=1)
    run(server, later, at=30)
    assert (later.cache_n, later.prompt_n) == (100, 3)
    busy = LlamaJob("x", [1], 50, slot=0)
    after = LlamaJob("y", [2], 1, slot=0)
    server.submit(busy, 40)
    server.submit(after, 40)
    server.step(40)
    assert server.processing == 1 and server.deferred == 1  # y waits for slot 0 although slot 1 is idle
