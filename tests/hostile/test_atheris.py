"""A short CI run of the atheris targets in tools/fuzz/ (the long campaign is ``tools/fuzz/run``).

Each target runs a few seconds in a subprocess, both at once, from an empty
corpus in a temporary directory; a finding (any exception or broken promise,
a crash file, a non-zero exit) fails the test with libFuzzer's report.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["grpc", "openai"]
SECONDS = 4

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris is not installed (pip install atheris; a manylinux wheel exists for CPython 3.11)",
), pytest.mark.slow]


def test_each_atheris_target_runs_without_a_finding(tmp_path):
    runs = {}
    for target in TARGETS:
        corpus = tmp_path / target
        corpus.mkdir()
        runs[target] = subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "fuzz" / f"fuzz_{target}.py"),
             f"-max_total_time={SECONDS}", "-max_len=4096", "-len_control=0", "-rss_limit_mb=2048",
             "-timeout=20", f"-artifact_prefix={tmp_path}/{target}-", str(corpus)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    for target, process in runs.items():
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, f"{target}: finding\n{output[-4000:]}"
        assert "Done" in output, output[-2000:]
        assert not list(tmp_path.glob(f"{target}-*")), f"{target} left a crash file"
