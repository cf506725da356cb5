"""tools/bench/admin_status_bench.py keeps working: it builds a status for the cluster and for one
tenant, the tenant's smaller, and journals requests; ``--json`` prints one object."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs tools/bench/admin_status_bench.py as a child process.
pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench" / "admin_status_bench.py"


def test_the_admin_status_bench_builds_both_scopes_and_prints_json():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--engines", "30", "--waiting", "50", "--requests", "200", "--json"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    result = json.loads(out)
    cluster, tenant = result["status"]
    assert (cluster["scope"], tenant["scope"]) == ("cluster", "t0")
    assert 0 < tenant["bytes"] < cluster["bytes"] and result["journal_us_per_request"] > 0
