"""docs/operations.md's operator walkthrough, followed word for word (issue 22, "Done when").

The section marked ``<!-- operator-walkthrough`` holds shell blocks an operator pastes one
after the other: two gateways peered one way only, two engine agents with the same engine id,
all from one directory. This test runs those blocks as written, in one ``bash`` from the
checkout, and checks that every model answered from both gateways. The walkthrough listens on
fixed ports (18080-18083, 28080-28083, outside the kernel's range for ``free_port()``), so
runs in other checkouts on this machine take turns on a lock file.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from harness.twistd_processes import ROOT

OPERATIONS = ROOT / "docs" / "operations.md"
MARKER = "<!-- operator-walkthrough"
#: The ports the walkthrough names, and the internal port next to each gateway's (a second worker's,
#: as ``--workers`` defaults to the cores and this machine may have two or more).
PORTS = (18080, 18082, 18083, 18084, 28080, 28082, 28083, 28084)
LOCK = Path("/tmp/infx-operator-walkthrough.lock")


def walkthrough_blocks(text: str) -> list[str]:
    """The ```sh blocks of the marked section, up to the next heading."""
    start = text.index(MARKER)
    end = text.find("\n#", start)
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"^```sh\n(.*?)^```$", section, flags=re.M | re.S)


def test_the_walkthrough_section_has_the_steps_the_test_relies_on():
    blocks = walkthrough_blocks(OPERATIONS.read_text())
    script = "\n".join(blocks)
    assert len(blocks) >= 3
    assert script.count("twistd -n --pidfile= infx ") == 2 and script.count("--peers") == 1
    assert script.count("--engine-id gpu-0") == 2


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as twistd listens: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(shutil.which("curl") is None, reason="the walkthrough uses curl")
def test_the_operator_walkthrough_run_as_written_serves_every_model_from_both_gateways(tmp_path: Path):
    script = "\n".join(walkthrough_blocks(OPERATIONS.read_text()))
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        taken = [port for port in PORTS if not _port_free(port)]
        assert not taken, f"the walkthrough's ports {taken} are in use on this machine"
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # where its `cd "$(mktemp -d)"` lands
        process = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        finished = True
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            finished = False  # a model never answered somewhere: its until-loop went on
        finally:
            os.killpg(process.pid, signal.SIGKILL)  # the gateways and agents it left running
        if not finished:
            output, _ = process.communicate(timeout=10)
    logs = {path.name: path.read_text() for path in tmp_path.glob("*/*.log")}
    context = output + "".join(f"\n--- {name}:\n{text[-2000:]}" for name, text in logs.items())
    assert finished, f"the walkthrough did not finish within 180 s\n{context}"
    assert process.returncode == 0, context
    for port in (18080, 28080):
        for model in ("model-a", "model-b"):
            assert re.search(rf'"content": ?"{model} via {port}"', output), context
    # B dials A back at the worker of A that dialled it first: with several workers (one per core by
    # default) the other worker's dial may still be in its back-off when every model answers.
    assert re.search(r"dialling it back at 127\.0\.0\.1:1808[34]", output), context
    assert output.count("connected to the gateway") == 2, context
    assert sorted(logs) == ["engine-a.log", "engine-b.log", "gateway-a.log", "gateway-b.log"]
    assert not any("ALREADY_EXISTS" in text or "Traceback" in text for text in logs.values()), context
