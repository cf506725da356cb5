"""Jittered, capped exponential backoff: the one delay rule for every redial.

Rules this file keeps: pure arithmetic, no clock, no randomness of its own:
the caller draws a uniform number from the rng it was given and passes it
in, so a simulation or a test decides every delay.

The rule is grpc/grpc ``doc/connection-backoff.md``: the n-th consecutive
failure waits ``min(cap, initial * factor**(n-1))`` moved by a uniform
fraction in ``[-jitter, +jitter]`` of itself, so replicas restarted together
do not redial in step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff", "GRPC_CONNECTION_BACKOFF"]


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts after consecutive failures.

    ``initial``: the delay after the first failure; ``factor``: growth per
    further failure; ``cap``: the longest delay before jitter; ``jitter``:
    the fraction (in [0, 1]) by which a delay is moved either way.
    """

    initial: float = 1.0
    factor: float = 1.6
    cap: float = 120.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.cap < self.initial or self.factor < 1:
            raise ValueError("backoff needs 0 < initial <= cap and factor >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter is a fraction in [0, 1]")

    def base(self, failures: int) -> float:
        """The delay before jitter after ``failures`` (>= 1) consecutive failures."""
        if failures < 1:
            raise ValueError("a backoff delay follows at least one failure")
        try:
            return min(self.cap, self.initial * self.factor ** (failures - 1))
        except OverflowError:
            return self.cap

    def delay(self, failures: int, draw: float) -> float:
        """The delay after ``failures`` consecutive failures; ``draw`` is a
        uniform number in [0, 1] from the caller's rng (0.5: no jitter)."""
        if not 0.0 <= draw <= 1.0:
            raise ValueError("draw is a uniform number in [0, 1]")
        return self.base(failures) * (1 + self.jitter * (2 * draw - 1))


#: The constants of grpc/grpc ``doc/connection-backoff.md``.
GRPC_CONNECTION_BACKOFF = Backoff(initial=1.0, factor=1.6, cap=120.0, jitter=0.2)
