"""Scaler benchmark: one autoscaler tick over 1,000 deployments, and first request -> scale write.

Targets from issue #7: a tick deciding 1,000 deployments in under 50 ms, and
under 10 ms in process from the first held request to the scale write being
issued. Run: ``.venv/bin/python tools/bench/scaler_bench.py [--deployments N]
[--ticks N] [--json]``; it prints medians (and p90/max) of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from twisted.internet import defer, task  # noqa: E402

from harness.scaler_fakes import InMemoryServiceQuery  # noqa: E402
from infx.scaling.scaler import InferenceScaler  # noqa: E402
from protocol.scaling.scaler import (  # noqa: E402
    MAX_SCALE_LABEL,
    MIN_SCALE_LABEL,
    MODELS_ANNOTATION,
    SCALABLE_LABEL,
    SCALE_TYPE_LABEL,
    TARGET_LOAD_LABEL,
    Scaler,
    ScaleWrite,
    deployment_snapshot,
)


def deployment(i: int, replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"engine-{i}", "namespace": "bench", "generation": 1,
                     "labels": {SCALABLE_LABEL: "true", MIN_SCALE_LABEL: str(i % 2),
                                MAX_SCALE_LABEL: "20", TARGET_LOAD_LABEL: "5",
                                SCALE_TYPE_LABEL: "rps" if i % 2 else "capacity"},
                     "annotations": {MODELS_ANNOTATION: f"model-{i},model-{i}-alt"}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": f"engine-{i}"}}},
    }


def bench_tick(count: int, ticks: int) -> list[float]:
    """Seconds per tick, with every deployment carrying load and full stable windows."""
    scaler = Scaler()
    now = 0.0
    for i in range(count):
        scaler.observe_deployment(deployment_snapshot(deployment(i, replicas=1 + i % 4)), now)
    samples = []
    for t in range(60 + ticks):
        now = float(t)
        for i in range(count):
            model = f"model-{i}"
            for _ in range(i % 3):
                scaler.request_started(model, now)
            if i % 3 == 2:
                scaler.request_finished(model, now)
        start = time.perf_counter()
        for effect in scaler.tick(now):
            # Perform writes in-process so the next tick decides again.
            if isinstance(effect, ScaleWrite):
                scaler.write_done(effect, effect.replicas, now)
        elapsed = time.perf_counter() - start
        if t >= 60:
            samples.append(elapsed)
    return samples


class _Recorder(InMemoryServiceQuery):
    """Notes when the replace (the write on the wire) is issued."""

    def __init__(self) -> None:
        super().__init__()
        self.issued_at: float | None = None

    def replace_scale(self, service: str, namespace: str, replicas: int,
                      resource_version: str) -> defer.Deferred[None]:
        if self.issued_at is None:
            self.issued_at = time.perf_counter()
        return super().replace_scale(service, namespace, replicas, resource_version)


def bench_first_request(runs: int, deployments: int) -> list[float]:
    """Seconds from hold() of the first request to the Scale replace being issued."""
    samples = []
    for _ in range(runs):
        query = _Recorder()
        scaler = InferenceScaler(task.Clock(), query, events=query)
        for i in range(deployments):
            scaler.observe_deployment(query.add(deployment(i, replicas=0)))
        start = time.perf_counter()
        scaler.hold(f"model-{deployments // 2}", timeout=600)
        assert query.issued_at is not None
        samples.append(query.issued_at - start)
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
            "max_ms": ordered[-1] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deployments", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {
        "tick": summary(bench_tick(args.deployments, args.ticks)),
        "first_request_to_write": summary(bench_first_request(args.runs, args.deployments)),
    }
    if args.json:
        print(json.dumps(results))
        return
    print(f"autoscaler tick, {args.deployments} deployments: "
          "median {median_ms:.2f} ms, p90 {p90_ms:.2f} ms, max {max_ms:.2f} ms (target < 50 ms)".format(
              **results["tick"]))
    print(f"first request -> scale write issued ({args.deployments} deployments known): "
          "median {median_ms:.3f} ms, p90 {p90_ms:.3f} ms, max {max_ms:.3f} ms (target < 10 ms)".format(
              **results["first_request_to_write"]))


if __name__ == "__main__":
    main()
