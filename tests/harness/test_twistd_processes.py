"""The real-process helpers of :mod:`harness.twistd_processes` themselves."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from harness import twistd_processes
from harness.twistd_processes import ChildDied, Gateway

#: Starts real twistd processes.
pytestmark = pytest.mark.e2e


def test_a_gateway_whose_port_was_taken_before_it_could_bind_starts_again_on_new_ports(tmp_path: Path, monkeypatch):
    """Another process may take a picked port before the child binds it: a new set of ports
    is tried, and the failed start's log is kept beside the new one."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        picks = iter([taken.getsockname()[1]])
        real = twistd_processes.free_port
        monkeypatch.setattr(twistd_processes, "free_port", lambda: next(picks, None) or real())
        gateway = Gateway(tmp_path, extra=["--echo-models", "m"])
        try:
            assert gateway.http_port != taken.getsockname()[1] and gateway.readyz() == 200
            assert "is already in use" in (tmp_path / "gateway.port-taken-0.log").read_text()
        finally:
            gateway.stop()


def test_a_gateway_that_exits_for_another_reason_is_not_started_again(tmp_path: Path):
    with pytest.raises(ChildDied, match="not valid YAML"):
        bad = tmp_path / "keys.yaml"
        bad.write_text("keys: [\n")
        Gateway(tmp_path, api_keys=bad)
    assert not list(tmp_path.glob("*.port-taken-*.log"))
