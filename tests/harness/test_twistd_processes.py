"""The real-process helpers of :mod:`harness.twistd_processes` themselves."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from harness import twistd_processes
from harness.twistd_processes import ChildDied, Gateway

#: Starts real twistd processes.
pytestmark = pytest.mark.e2e


def test_a_gateway_that_exits_for_another_reason_is_not_started_again(tmp_path: Path):
    with pytest.raises(ChildDied, match="not valid YAML"):
        bad = tmp_path / "keys.yaml"
        bad.write_text("keys: [\n")
        Gateway(tmp_path, api_keys=bad)


def test_a_gateway_binds_only_ports_the_kernel_picks_and_knows_them_and_its_name(tmp_path: Path, monkeypatch):
    """No port of one gateway process is picked beforehand (none can be taken before it binds):
    its HTTP, engine and internal port are read from its log, and it names itself by the last."""

    def no_picking() -> int:
        raise AssertionError("a port picked for a gateway could be taken before it binds")

    monkeypatch.setattr(twistd_processes, "free_port", no_picking)
    gateway = Gateway(tmp_path, extra=["--echo-models", "m"])
    try:
        assert gateway.readyz() == 200 and 0 not in (gateway.http_port, gateway.worker_port, gateway.internal_port)
        assert gateway.internal_ports == (gateway.internal_port,)
        gateway.wait_for_engine(gateway.builtin_engine_id)  # the engine's id carries the pod name
        assert gateway.status()["gateway"]["pod"] == gateway.pod_name == f"127.0.0.1:{gateway.internal_port}"
        with socket.create_connection(("127.0.0.1", gateway.worker_port), timeout=5):
            pass
    finally:
        gateway.stop()


def test_a_gateway_of_workers_binds_only_ports_the_kernel_picks_and_knows_them(tmp_path: Path, monkeypatch):
    """No port of a supervisor is picked beforehand (none can be taken before it binds): its
    HTTP, engine and each worker's internal port are read from its log."""

    def no_picking() -> int:
        raise AssertionError("a port picked for a supervisor could be taken before it binds")

    monkeypatch.setattr(twistd_processes, "free_port", no_picking)
    gateway = Gateway(tmp_path, workers=2, extra=["--echo-models", "m"])
    try:
        assert gateway.readyz() == 200 and len(set(gateway.internal_ports)) == 2
        assert gateway.internal_port == gateway.internal_ports[0] and gateway.worker_port not in (0, gateway.http_port)
        for index, port in enumerate(gateway.internal_ports):
            assert f"127.0.0.1:{port}" == gateway.worker_pod_name(index)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
    finally:
        gateway.stop()
