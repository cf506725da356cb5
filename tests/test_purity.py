"""protocol/ stays pure: no reactor, sockets, threads or clock reads, and strictly typed."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(
    r"^\s*(import|from)\s+(twisted|socket|threading|asyncio|select|selectors|subprocess)\b"
    r"|\btime\.(time|monotonic|perf_counter|sleep)\("
    r"|\bdatetime\.now\(",
    re.MULTILINE,
)


def test_protocol_package_has_no_io_or_clock_reads():
    offenders = []
    for path in (ROOT / "protocol").rglob("*.py"):
        if "pb" in path.relative_to(ROOT / "protocol").parts:
            continue
        for match in FORBIDDEN.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_protocol_package_passes_mypy_strict():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"), "-p", "protocol"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
