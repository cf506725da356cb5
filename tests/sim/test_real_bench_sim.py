"""The real benchmark simulated (harness/sim/routing/real_bench.py): infx's pure machines in front of modelled
llama-servers, on the benchmark's own requests. Its agreement with the real runs is
tests/bench/test_real_routing.py's; here what it is on its own: complete, deterministic, and the check."""

from __future__ import annotations

from harness.gguf_models import TINY
from harness.real_routing.workloads import make
from harness.sim.routing.llama import TINY_COSTS
from harness.sim.routing.real_bench import calibration_problems, simulate_run


def test_every_request_is_answered_once_with_the_runtimes_own_counts():
    workload = make("shared", 1, 0.25)
    run = simulate_run(workload, "affinity", 3, 1)
    assert run.figures.requests == workload.requests == len(run.records) and run.figures.errors == 0
    assert len({(r.conversation, r.turn) for r in run.records}) == workload.requests
    for r in run.records:
        conversation = next(c for client in workload.clients for c in client.conversations if c.id == r.conversation)
        assert r.prompt_tokens == len(conversation.prompt_tokens(r.turn)) and r.first is not None


def test_a_seed_replays_exactly():
    workload = make("pressure", 2, 0.2)
    a = simulate_run(workload, "affinity", 3, 2, costs=TINY_COSTS, bytes_per_token=TINY.kv_bytes_per_token)
    b = simulate_run(workload, "affinity", 3, 2, costs=TINY_COSTS, bytes_per_token=TINY.kv_bytes_per_token)
    assert a.records == b.records


def test_affinity_keeps_the_shared_prompts_where_round_robin_scatters_them():
    workload = make("shared", 1, 0.5)
    affinity, spread = (simulate_run(workload, policy, 1, 1).figures for policy in ("affinity", "round_robin"))
    assert affinity.cached_share > spread.cached_share + 0.05
    assert affinity.moved < spread.moved


def test_load_reports_off_and_a_cap_are_the_benchmarks_variants():
    # Not chat: with load reports stamped, its half-scale run routes alike with them, without and capped.
    workload = make("pressure", 1, 0.5)
    plain = simulate_run(workload, "affinity", 1, 1)
    quiet = simulate_run(workload, "affinity", 1, 1, load_reports=False)
    capped = simulate_run(workload, "affinity", 1, 1, max_in_flight=2)
    assert plain.figures.requests == quiet.figures.requests == capped.figures.requests == workload.requests
    assert plain.records != quiet.records or plain.records != capped.records


def test_calibration_problems_name_a_share_off_by_more_than_the_tolerance_and_an_inverted_ranking():
    real = {("w", 1, "a"): 0.80, ("w", 1, "b"): 0.70, ("w", 1, "c"): 0.69}
    assert calibration_problems(real, {("w", 1, "a"): 0.78, ("w", 1, "b"): 0.72, ("w", 1, "c"): 0.70}) == []
    # b and c are within the tolerance of each other for real: their order does not count.
    assert calibration_problems(real, {("w", 1, "a"): 0.80, ("w", 1, "b"): 0.69, ("w", 1, "c"): 0.70}) == []
    off = calibration_problems(real, {("w", 1, "a"): 0.84, ("w", 1, "b"): 0.70, ("w", 1, "c"): 0.69})
    assert len(off) == 1 and "('w', 1, 'a'): simulated 84.0%, real 80.0%" in off[0]
    inverted = calibration_problems({("w", 1, "a"): 0.80, ("w", 1, "b"): 0.70},
                                    {("w", 1, "a"): 0.72, ("w", 1, "b"): 0.73}, tolerance=0.10)
    assert len(inverted) == 1 and "reuses more than" in inverted[0]


def test_spilled_tips_reach_peers_at_once_and_loads_within_the_relay_interval():
    """relay_interval is --status-interval / 4: within it a gateway's changed loads reach its peers, while a
    change beyond load counts (a spilled tip) reaches them at once, as the exchange sends it. Chat's later
    turns follow their tips from any gateway whatever the interval; pressure's choices move with the loads."""
    chat = make("chat", 1)
    slow = simulate_run(chat, "affinity", 3, 1)
    fast = simulate_run(chat, "affinity", 3, 1, relay_interval=0.25)
    assert slow.records == fast.records and slow.figures.moved_off_free_home == 0
    pressure = make("pressure", 1)
    assert simulate_run(pressure, "affinity", 3, 1).records != \
        simulate_run(pressure, "affinity", 3, 1, relay_interval=0.25).records


def test_slots_kept_restore_the_conversations_the_runtimes_pushed_out_under_pressure():
    """The lever of docs/routing-real.md part 6, simulated: pressure's later turns find their earlier prompt."""
    workload = make("pressure", 1)
    plain = simulate_run(workload, "affinity", 1, 1).figures
    kept = simulate_run(workload, "affinity", 1, 1, slot_files=64).figures
    assert kept.cached_share > plain.cached_share + 0.2
    assert kept.errors == 0 and kept.requests == plain.requests


def test_keeping_slots_costs_a_burst_of_one_question_conversations_no_cache():
    """Restores never overwrite a context the server keeps nowhere else (protocol/agent/slot_keeper.py): the
    burst's shared system prompt, in slots its one-question conversations just left, stays on its engines."""
    workload = make("bursty", 2)
    plain = simulate_run(workload, "affinity", 1, 2).figures
    kept = simulate_run(workload, "affinity", 1, 2, slot_files=64).figures
    assert kept.cached_share > plain.cached_share - 0.01
    assert kept.errors == 0 and kept.requests == plain.requests
