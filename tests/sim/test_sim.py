"""The whole cluster in memory (harness/sim): seeded runs hold every invariant, a seed
replays exactly, and a bug planted in the processor or in the production gateway
core (the glue the sim drives) is reported with the invariant it breaks and a
command that replays it."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest

from harness.sim import SimConfig, run_seed
from harness.sim.__main__ import main
from harness.sim.invariants import (
    CONVERGENCE,
    DEADLINE,
    LIVENESS,
    NO_LOOP,
    ORDER,
    TENANT,
    ClientRequest,
)
from harness.sim.scale import report
from protocol.exchange import accepted_peer
from protocol.gateway.core import GatewayCore
from protocol.gateway.dialling import Dialling
from protocol.gateway.effects import SendOnDial
from protocol.pb import status_pb2
from protocol.processor.core import Processor, TaskState
from protocol.processor.dispatcher import TaskDispatcher
from protocol.processor.endings import Endings
from protocol.processor.effects import EnginesRemoved

ROOT = Path(__file__).resolve().parents[2]
SUITE_STEPS = 500


@pytest.mark.parametrize("seed", range(24))
def test_seeded_cluster_run_with_faults_holds_every_invariant(seed):
    """Faults, load, heal, converge, probe, drain: nothing ends twice or out of order, no
    tenant leak, no loop, every gateway learns every up engine (F1), probes succeed after
    the faults stop (F2), memory is freed (F3); see harness/sim/FINDINGS.md."""
    result = run_seed(seed, SimConfig(steps=SUITE_STEPS))
    assert result.ok, result.describe()
    assert result.stats["requests"] > 0 and result.stats["invariant_checks"] > 0


def _drop_one_result(monkeypatch):
    """Plant a bug: the processor swallows the first mid-stream result it should hand to a
    client. (Dropped on its way to a peer, the peer's processor sees the gap and fails the
    request with a 502, which is the protocol working, not a violation.)"""
    original = Endings.deliver
    dropped = []

    def deliver(self, task, result, last, effects):
        if not dropped and task.next_index >= 1 and not last and isinstance(task.origin, ClientRequest):
            dropped.append(task.id)
            task.next_index += 1
            return
        original(self, task, result, last, effects)

    monkeypatch.setattr(Endings, "deliver", deliver)
    return dropped


def _route_across_tenants(monkeypatch):
    """Plant a bug: routing looks at every tenant's engines, not only the task's tenant."""

    def pick(self, task, ignore_cap=False):
        for _, engines in self._engines.by_tenant():
            for engine in engines.values():
                if engine.routable and task.model in engine.ready_models:
                    return engine
        return None

    monkeypatch.setattr(TaskDispatcher, "pick", pick)


def _first_failure(seeds=range(10), full_checks=False):
    for seed in seeds:
        result = run_seed(seed, SimConfig(steps=SUITE_STEPS, full_checks=full_checks))
        if not result.ok:
            return result
    raise AssertionError("no seed caught the planted bug")


def _forget_dispatched_deadlines(monkeypatch):
    """Plant a bug: the processor forgets the deadline of a task waiting for its engine's answer."""
    original = Processor._task_timer

    def task_timer(self, now, task, effects):
        if task.state is TaskState.DISPATCHED and now >= task.deadline:
            return
        original(self, now, task, effects)

    monkeypatch.setattr(Processor, "_task_timer", task_timer)


def _bring_back_f1(monkeypatch):
    """Plant finding F1 again: a peer's engines are named by their bare ids (as before issue 22),
    so one attached to another gateway while its old stream here lingers is shadowed, and
    ``EnginesRemoved`` is dropped instead of letting every peer's accepted peer register it once the
    shadow goes."""
    original = GatewayCore._absorb

    def absorb(self, effects, now, out):
        original(self, [e for e in effects if not isinstance(e, EnginesRemoved)], now, out)

    monkeypatch.setattr(GatewayCore, "_absorb", absorb)
    monkeypatch.setattr(accepted_peer, "peer_engine_id", lambda engine_id, pod_name: engine_id)


def test_a_dropped_result_is_reported_as_out_of_order_with_a_replay_command(monkeypatch):
    dropped = _drop_one_result(monkeypatch)
    result = _first_failure()
    assert dropped
    assert result.violation.invariant == ORDER
    assert dropped[0] in result.violation.detail
    assert f"replay: tools/sim --seed {result.seed} --steps {SUITE_STEPS}" in result.describe()
    # The replay finds the same violation at the same point.
    dropped.clear()
    again = run_seed(result.seed, SimConfig(steps=SUITE_STEPS))
    assert (again.violation.invariant, again.violation.detail, again.digest) == (
        ORDER, result.violation.detail, result.digest)


def test_routing_across_tenants_is_reported_as_a_tenant_leak(monkeypatch):
    _route_across_tenants(monkeypatch)
    result = _first_failure()
    assert result.violation.invariant == TENANT
    assert "of tenant" in result.violation.detail
    assert result.replay == f"tools/sim --seed {result.seed} --steps {SUITE_STEPS}"


def test_advertising_remote_engines_is_reported_as_a_loop(monkeypatch):
    """Plant a bug: a gateway reports every engine it knows to its peers, remote ones too."""

    def every_engine(self):
        out = []
        for engine in self._engines.values():
            copy = status_pb2.EngineStatus()
            copy.CopyFrom(engine.status)
            out.append((engine.key.tenant_id, copy))
        return out

    monkeypatch.setattr(Processor, "local_engines", every_engine)
    result = _first_failure()
    assert result.violation.invariant == NO_LOOP
    assert "but it is not attached there" in result.violation.detail


def test_a_deadline_that_never_fires_is_reported(monkeypatch):
    _forget_dispatched_deadlines(monkeypatch)
    result = _first_failure()
    assert result.violation.invariant == DEADLINE
    assert "still in flight" in result.violation.detail


# --- bugs planted in the production glue (protocol/gateway/), which the sim drives ---------


def test_a_forwarded_result_relayed_twice_by_the_core_is_caught(monkeypatch):
    """Plant a bug in the gateway's dials: every result of a task a peer forwarded here goes
    back to that peer twice. The peer's processor must not hand a client anything twice."""
    original = Dialling.relay
    relayed: list[str] = []

    def relay_twice(self, dial, effect, now, out):
        original(self, dial, effect, now, out)
        again = [e for e in out[-1:] if isinstance(e, SendOnDial) and e.message.HasField("task_result")]
        if again:
            relayed.append(effect.task_id)
            out.extend(again)

    monkeypatch.setattr(Dialling, "relay", relay_twice)
    result = _first_failure()
    assert relayed, "the planted bug never ran"
    # The peer's processor sees the duplicate as a result out of order and fails the request
    # with a 502: a probe after the faults stopped fails.
    assert result.violation.invariant == LIVENESS and "expected 1" in result.violation.detail, result.describe()


def test_engines_shadowed_by_their_bare_ids_are_caught(monkeypatch):
    """Finding F1 planted again (see ``_bring_back_f1``): some gateway never learns an engine
    that is up. Named with their pods, the same seeds pass (tests below)."""
    _bring_back_f1(monkeypatch)
    result = _first_failure(range(40))
    assert result.violation.invariant in (CONVERGENCE, LIVENESS), result.describe()


def test_the_campaign_command_fails_and_prints_the_replay_of_each_failing_seed(monkeypatch, capsys):
    _route_across_tenants(monkeypatch)
    assert main(["--seeds", "4", "--steps", "300"]) == 1
    out = capsys.readouterr().out
    failing = re.findall(rf"^seed (\d+): invariant {TENANT} violated", out, flags=re.M)
    assert failing, out
    for seed in failing:
        assert f"replay: tools/sim --seed {seed} --steps 300" in out


@pytest.mark.e2e
def test_a_seed_replays_identically_in_other_processes_whatever_their_hash_seed():
    """Nothing in the cluster may depend on set order of strings (PYTHONHASHSEED)."""
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([str(ROOT / "tools" / "sim"), "--seed", "24", "--steps", "400"], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        digests.add(out.split("digest ")[1].split("]")[0])
    local = run_seed(24, SimConfig(steps=400)).digest
    assert digests == {local}


# --- incremental invariants (harness/sim/checks.py) against the full recomputation ----------------


@pytest.mark.parametrize("seed, config", [
    *((seed, SimConfig(steps=SUITE_STEPS)) for seed in range(3)),
    (0, SimConfig(steps=1000, gateways=6, engines=(12, 12), models=("m1", "m2", "m3"), fault_interval=0.3)),
], ids=["0", "1", "2", "0-6x12"])
def test_incremental_and_full_checks_agree_step_for_step(seed, config):
    """The checks only read, so both modes run the same steps (same digest) and agree on the outcome."""
    incremental = run_seed(seed, config)
    full = run_seed(seed, dataclasses.replace(config, full_checks=True))
    assert (incremental.ok, incremental.digest, incremental.stats["steps"]) == (
        full.ok, full.digest, full.stats["steps"]), (incremental.describe(), full.describe())
    assert incremental.ok, incremental.describe()
    # The point of the index: fewer checks for the same verdict.
    assert incremental.stats["invariant_checks"] < full.stats["invariant_checks"]


@pytest.mark.parametrize("plant, invariants, seeds", [
    (_forget_dispatched_deadlines, (DEADLINE,), range(10)),
    (_bring_back_f1, (CONVERGENCE, LIVENESS), range(40)),
], ids=["deadline", "f1"])
def test_a_planted_bug_is_caught_the_same_way_by_incremental_and_full_checks(monkeypatch, plant, invariants,
                                                                             seeds):
    plant(monkeypatch)
    incremental = _first_failure(seeds)
    full = _first_failure(seeds, full_checks=True)
    assert incremental.violation.invariant in invariants, incremental.describe()
    assert (incremental.seed, incremental.violation.invariant, incremental.violation.detail, incremental.digest) == (
        full.seed, full.violation.invariant, full.violation.detail, full.digest)
    assert full.replay == f"tools/sim --seed {full.seed} --steps {SUITE_STEPS} --full-checks"


def test_the_shape_and_load_options_reach_the_run_and_its_replay_command(capsys):
    assert main(["--seed", "3", "--steps", "200", "--gateways", "4", "--engines", "9", "--models", "3",
                 "--request-interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "seed 3: ok" in out
    assert "--gateways 4 --engines 9 --models 3 --request-interval 0.05" in out
    result = run_seed(3, SimConfig(steps=200, gateways=4, engines=(9, 9), models=("m1", "m2", "m3"),
                                   request_interval=0.05))
    assert f"digest {result.digest}" in out
    assert result.replay == "tools/sim --seed 3 --steps 200 --gateways 4 --engines 9 --models 3 --request-interval 0.05"


# --- the scale report (tools/sim --report) ------------------------------------------------------


def test_the_scale_report_measures_the_exchange_and_is_deterministic():
    """A 3-gateway row: status traffic, exchanged and cold-start latencies, convergence after a
    restart; the same seed gives the same row (CPU time aside)."""
    lines: list[str] = []
    first = report((3,), lines.append, window_requests=40)[0]
    again = report((3,), lambda line: None, window_requests=40)[0]
    assert dataclasses.replace(first, cpu=0.0) == dataclasses.replace(again, cpu=0.0)
    assert (first.gateways, first.engines) == (3, 30)
    assert first.status_messages > 0 and first.status_bytes > first.status_messages
    assert first.exchanged > 0 and 0 < first.exchange_ms[0] <= first.exchange_ms[1]
    # Cold start is counted from the engine's start: it includes its connecting and first report.
    assert 0 < first.cold_start_ms[0] <= first.cold_start_ms[1]
    assert first.restart_intervals is not None and first.restart_intervals > 0
    assert lines[-1].startswith("| 3 | 30 | ")
