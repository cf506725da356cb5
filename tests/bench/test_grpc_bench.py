"""tools/bench/grpc_bench.py runs every implementation and test and reports one JSON object per pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs tools/bench/grpc_bench.py as a child process.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"unary": "round trips/s", "stream_1k": "messages/s", "stream_1m": "MB/s"}


def test_quick_json_run_reports_a_positive_median_per_impl_and_test() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "grpc_bench.py"), "--quick", "--json", "--duration", "0.05"],
        # A ceiling for a hung run only: on a loaded 2-core box the nine client processes take 25 s and more.
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(set(row) == {"impl", "test", "median", "unit"} for row in rows)
    assert sorted((row["impl"], row["test"]) for row in rows) == sorted(
        (impl, test) for impl in ("infx", "grpclib", "grpcio") for test in UNITS
    )
    assert all(row["unit"] == UNITS[row["test"]] for row in rows)
    assert all(isinstance(row["median"], float) and row["median"] > 0 for row in rows), rows
