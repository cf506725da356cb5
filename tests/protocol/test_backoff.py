"""protocol.backoff: the one redial delay rule (grpc/grpc doc/connection-backoff.md)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.backoff import GRPC_CONNECTION_BACKOFF, Backoff


def test_without_jitter_the_delay_grows_by_the_factor_up_to_the_cap() -> None:
    backoff = Backoff(initial=1.0, factor=2.0, cap=5.0, jitter=0.0)
    assert [backoff.delay(n, 0.9) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_the_draw_moves_the_delay_within_plus_or_minus_the_jitter() -> None:
    backoff = Backoff(initial=10.0, factor=2.0, cap=100.0, jitter=0.2)
    assert backoff.delay(1, 0.0) == pytest.approx(8.0)
    assert backoff.delay(1, 0.5) == pytest.approx(10.0)
    assert backoff.delay(1, 1.0) == pytest.approx(12.0)


def test_grpc_spec_constants() -> None:
    assert (GRPC_CONNECTION_BACKOFF.initial, GRPC_CONNECTION_BACKOFF.factor,
            GRPC_CONNECTION_BACKOFF.cap, GRPC_CONNECTION_BACKOFF.jitter) == (1.0, 1.6, 120.0, 0.2)


def test_a_huge_failure_count_is_the_cap_not_an_overflow() -> None:
    assert Backoff(initial=1.0, factor=10.0, cap=30.0, jitter=0.0).delay(10_000, 0.5) == 30.0


@pytest.mark.parametrize("kwargs", [
    dict(initial=0.0), dict(initial=2.0, cap=1.0), dict(factor=0.5), dict(jitter=-0.1),
    dict(jitter=1.5),
])
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_a_delay_needs_a_failure_and_a_draw_in_the_unit_interval() -> None:
    with pytest.raises(ValueError):
        GRPC_CONNECTION_BACKOFF.delay(0, 0.5)
    with pytest.raises(ValueError):
        GRPC_CONNECTION_BACKOFF.delay(1, 1.5)


@given(st.floats(0.01, 5), st.floats(1, 4), st.floats(0, 1), st.integers(1, 300),
       st.integers(0, 2**32))
def test_every_delay_stays_within_jitter_of_the_capped_exponential(
        initial: float, factor: float, jitter: float, failures: int, seed: int) -> None:
    cap = initial * 10
    backoff = Backoff(initial=initial, factor=factor, cap=cap, jitter=jitter)
    base = min(cap, initial * factor ** (failures - 1))
    delay = backoff.delay(failures, random.Random(seed).random())
    assert base * (1 - jitter) - 1e-9 <= delay <= base * (1 + jitter) + 1e-9
