"""The deterministic in-memory cluster simulation (issue #8).

N gateways (the real processor, dialled peers, accepted peers and gRPC machines) and M
engines (the real engine agent core with a scripted runtime) joined by
in-memory links that carry the real HTTP/2 bytes, one virtual clock, seeded
latencies and a seeded scheduler, faults injected at random points, and the
cluster's invariants checked after every step. One seed is one run and
replays exactly: ``tools/sim --seed N --steps M``; ``tools/sim --seeds 1000``
runs a campaign.

Public API: :func:`run_seed`, :class:`SimConfig`, :class:`SimResult`,
:class:`InvariantViolated`, :data:`INVARIANTS`.
"""

from harness.sim.cluster import Cluster, SimConfig, SimResult, run_seed
from harness.sim.invariants import INVARIANTS, InvariantViolated

__all__ = ["INVARIANTS", "Cluster", "InvariantViolated", "SimConfig", "SimResult", "run_seed"]
