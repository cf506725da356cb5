"""Small seeds of the routing simulation (harness/sim/routing): the direction of the issue's
targets, robustly, and determinism. The full table is ``tools/routing_sim --check``."""

import pytest

from harness.sim.routing.run import simulate
from harness.sim.routing.runtime import RuntimeSpec

# A quarter of the clients on half the engines, each with a third of the full run's cache, so
# that the caches stay under pressure (with the full cache every engine soon holds every prompt
# of so few clients, whatever the routing).
SMALL = dict(duration=15.0, warmup=3.0, scale=0.25, engines=4, spec=RuntimeSpec(cache_blocks=2000))


@pytest.fixture(scope="module")
def results():
    return {
        (workload, policy, gateways): simulate(workload, policy, gateways, 2, **SMALL)
        for workload in ("shared-prefix", "multi-turn")
        for policy in ("least_in_progress", "affinity")
        for gateways in (1, 3)
    }


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
@pytest.mark.parametrize("gateways", [1, 3])
def test_affinity_hits_the_cache_and_serves_more_than_least_in_progress(results, workload, gateways):
    infx, lip = results[(workload, "affinity", gateways)], results[(workload, "least_in_progress", gateways)]
    assert infx.hit_rate > lip.hit_rate + 0.25
    assert infx.tokens_per_second > 1.1 * lip.tokens_per_second
    assert infx.ttft_mean() < lip.ttft_mean()
    assert infx.failed == lip.failed == 0


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_three_gateways_route_about_as_well_as_one(results, workload):
    one, three = results[(workload, "affinity", 1)], results[(workload, "affinity", 3)]
    assert three.hit_rate > 0.9 * one.hit_rate
    assert three.tokens_per_second > 0.9 * one.tokens_per_second


def test_three_gateways_share_spilled_conversations_and_route_within_five_percent_of_one():
    """At full load (8 engines, 128 conversations) bounded load spills turns off their homes;
    with the spilled tips shared through the exchange the next turn finds its cache from any
    gateway, without them it is sent home by the gateways that did not move it."""
    from protocol.routing.config import RoutingConfig

    full = dict(duration=30.0, warmup=5.0)
    one = simulate("multi-turn", "affinity", 1, 2, **full)
    shared = simulate("multi-turn", "affinity", 3, 2, **full)
    alone = simulate("multi-turn", "affinity", 3, 2, routing=RoutingConfig(spilled_tips=0), **full)
    assert shared.hit_rate >= 0.95 * one.hit_rate and shared.tokens_per_second >= 0.95 * one.tokens_per_second
    assert shared.hit_rate > alone.hit_rate + 0.02


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn"])
def test_affinity_keeps_the_engines_evenly_loaded(results, workload):
    for gateways in (1, 3):
        assert results[(workload, "affinity", gateways)].load_imbalance <= 1.35


def test_a_seed_replays_exactly():
    a = simulate("multi-turn", "affinity", 3, 5, duration=8.0, warmup=2.0, scale=0.1, engines=3)
    b = simulate("multi-turn", "affinity", 3, 5, duration=8.0, warmup=2.0, scale=0.1, engines=3)
    assert (a.requests, a.cached_tokens, a.output_tokens, a.ttft) == (b.requests, b.cached_tokens, b.output_tokens, b.ttft)
    assert a.requests > 0


@pytest.mark.e2e
def test_a_seed_replays_exactly_in_another_process_with_another_hash_seed():
    import os
    import subprocess
    import sys

    code = ("from harness.sim.routing.run import simulate; "
            "r = simulate('shared-prefix', 'affinity', 3, 4, duration=6.0, warmup=1.0, scale=0.05, engines=3); "
            "print(r.requests, r.cached_tokens, r.output_tokens, sorted(r.load_samples.items()))")
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and outputs.pop().split()[0] != "0"


@pytest.mark.slow
@pytest.mark.parametrize("gateways", [1, 3])
def test_a_bursty_tenant_leaves_the_others_time_to_first_token_within_one_and_a_half_times(gateways):
    """With engines capped at their batch, fairness by slots held and the reserve keep the steady
    callers' p99 TTFT during another caller's burst within 1.5x of theirs without it, also when
    every gateway sends to every engine; without the reserve they wait behind the burst."""
    run = dict(duration=40.0, fair_queue=32)
    calm = simulate("bursty-baseline", "affinity", gateways, 1, **run).ttft_p99("steady")
    fair = simulate("bursty", "affinity", gateways, 1, **run)
    no_reserve = simulate("bursty", "affinity", gateways, 1, fair_reserve=0, **run)
    assert fair.ttft_p99("steady") <= 1.5 * calm
    assert fair.ttft_p99("steady") < no_reserve.ttft_p99("steady")
    assert fair.ttft.get("burst") and fair.failed == 0  # the burst is served, and nothing is lost
