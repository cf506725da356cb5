"""tools/bench/processor_bench.py keeps working: every scenario completes all its tasks
(the bench asserts it) and ``--json`` prints one object per scenario and line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs tools/bench/processor_bench.py as a child process.
pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench" / "processor_bench.py"


def test_the_processor_bench_runs_every_scenario_and_prints_json_lines():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--tasks", "200", "--backlog", "300", "--json"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["scenario"], r["engines"]) for r in records] == [
        ("route", 1), ("route", 10), ("route", 100), ("stream", 1), ("stream", 100), ("spread", 1000),
        ("backlog", 1)]
    assert records[-1]["tasks"] == 300 and all(r["tasks_per_s"] > 0 for r in records)
