"""The worker pool's decisions, stepped by hand: start, restart with backoff, start-up failure, drain, kill."""

from __future__ import annotations

import pytest

from protocol.backoff import Backoff
from protocol.errors import LocalUsageError
from protocol.supervisor.pool import (
    EXIT_WORKER_FAILED, KillWorker, PoolConfig, PoolListening, PoolStopped, SpawnWorker, StopWorker, WorkerPool,
    WorkerRestartDue, WorkerState,
)

BACKOFF = Backoff(initial=0.5, factor=2.0, cap=4.0, jitter=0.0)


def up_pool(workers: int = 2) -> WorkerPool:
    pool = WorkerPool(PoolConfig(workers=workers, kill_after=40.0, stable_after=10.0, restart_backoff=BACKOFF))
    assert pool.start(0.0) == [SpawnWorker(i, 1) for i in range(workers)]
    for index in range(workers):
        assert pool.spawned(index, 0.1) == []
    effects = [effect for index in range(workers) for effect in pool.listening(index, 1.0)]
    assert effects == [PoolListening()]
    return pool


def test_the_pool_is_up_once_every_worker_listens_and_says_so_once():
    pool = up_pool(3)
    assert pool.up and all(pool.state(i) is WorkerState.LISTENING for i in range(3))
    assert pool.next_deadline() is None


def test_a_worker_that_exits_is_restarted_after_a_backoff_that_grows_while_it_dies_young():
    pool = up_pool()
    assert pool.exited(1, None, 5.0) == [WorkerRestartDue(1, None, 0.5)]
    assert pool.state(1) is WorkerState.WAITING and pool.state(0) is WorkerState.LISTENING
    assert pool.next_deadline() == 5.5
    assert pool.handle_timeout(5.4) == []
    assert pool.handle_timeout(5.5) == [SpawnWorker(1, 2)]
    pool.spawned(1, 5.6)
    assert pool.exited(1, 3, 6.0) == [WorkerRestartDue(1, 3, 1.0)]  # died young: longer
    assert pool.handle_timeout(7.0) == [SpawnWorker(1, 3)]
    pool.spawned(1, 7.0)
    assert pool.listening(1, 8.0) == []  # the pool was up already
    assert pool.exited(1, None, 30.0) == [WorkerRestartDue(1, None, 0.5)]  # it lived: the shortest delay again


def test_the_delay_stops_growing_at_the_cap():
    pool = up_pool(1)
    now = 2.0
    delays = []
    for _ in range(6):
        (due,) = pool.exited(0, 1, now)
        delays.append(due.delay)
        now += due.delay
        pool.handle_timeout(now)
        pool.spawned(0, now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_worker_that_fails_before_the_pool_was_ever_up_stops_the_pool_with_a_failure():
    pool = WorkerPool(PoolConfig(workers=2, restart_backoff=BACKOFF))
    pool.start(0.0)
    pool.spawned(0, 0.1)
    pool.spawned(1, 0.1)
    pool.listening(0, 1.0)
    assert pool.exited(1, 2, 1.5) == [StopWorker(0)]
    assert pool.state(1) is WorkerState.STOPPED
    assert pool.exited(0, 0, 2.0) == [PoolStopped(EXIT_WORKER_FAILED, "worker 1 exited with code 2 before it listened")]


def test_stop_drains_every_live_worker_then_kills_those_that_outlive_the_grace_period():
    pool = up_pool(3)
    pool.exited(2, None, 3.0)  # waiting for its restart: nothing to stop
    assert pool.stop(10.0) == [StopWorker(0), StopWorker(1)]
    assert pool.stop(10.5) == []
    assert pool.state(2) is WorkerState.STOPPED
    assert pool.next_deadline() == 50.0
    assert pool.exited(0, 0, 12.0) == []
    assert pool.handle_timeout(50.0) == [KillWorker(1)]
    assert pool.next_deadline() is None
    assert pool.exited(1, None, 50.1) == [PoolStopped(0)]


def test_a_worker_asked_for_while_the_pool_stops_is_stopped_as_soon_as_it_runs():
    pool = up_pool(1)
    pool.exited(0, None, 2.0)
    assert pool.handle_timeout(2.5) == [SpawnWorker(0, 2)]
    assert pool.stop(2.6) == []
    assert pool.spawned(0, 2.7) == [StopWorker(0)]
    assert pool.exited(0, 0, 3.0) == [PoolStopped(0)]


def test_a_stop_with_no_live_process_ends_at_once():
    pool = up_pool(1)
    pool.exited(0, None, 2.0)
    assert pool.stop(2.1) == [PoolStopped(0)]


def test_inputs_out_of_turn_are_the_callers_bug():
    pool = WorkerPool(PoolConfig(workers=1))
    pool.start(0.0)
    with pytest.raises(LocalUsageError):
        pool.start(0.0)
    with pytest.raises(LocalUsageError):
        pool.exited(0, 0, 1.0)  # never ran
    pool.spawned(0, 0.1)
    with pytest.raises(LocalUsageError):
        pool.spawned(0, 0.2)
    with pytest.raises(LocalUsageError):
        PoolConfig(workers=0)
