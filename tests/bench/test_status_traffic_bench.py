"""tools/bench/status_traffic.py keeps working: it runs the simulation for each shape given and
prints one JSON object per shape, with status messages and bytes per gateway."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs tools/bench/status_traffic.py as a child process.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "status_traffic.py"


def test_the_status_traffic_bench_prints_messages_and_bytes_per_gateway_for_each_shape():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(BENCH), "--shapes", "2x2,3x4", "--seeds", "1", "--steps", "40", "--json"],
        capture_output=True, text=True, check=True, timeout=120, env=env, cwd=ROOT,
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["gateways"], r["engines"]) for r in records] == [(2, 2), (3, 4)]
    assert all(r["failed_seeds"] == 0 and r["status_messages_per_gateway"] > 0 for r in records)
    assert all(r["status_bytes_per_gateway"] > r["status_messages_per_gateway"] for r in records)
