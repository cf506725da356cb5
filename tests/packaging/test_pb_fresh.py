"""protocol/pb/ must be exactly what tools/gen_proto makes from proto/ today."""

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Runs tools/gen_proto (protoc) as a child process.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto_sources(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "tools" / "gen_proto"), str(tmp_path)], cwd=ROOT, env=env, check=True)
    committed = ROOT / "protocol" / "pb"
    for fresh in sorted(tmp_path.rglob("*_pb2.py*")):
        relative = fresh.relative_to(tmp_path)
        assert filecmp.cmp(fresh, committed / relative, shallow=False), (
            f"protocol/pb/{relative} is stale: run tools/gen_proto"
        )
    stale = {p.relative_to(committed) for p in committed.rglob("*_pb2.py*")}
    fresh_names = {p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2.py*")}
    assert stale == fresh_names, "protocol/pb/ holds modules with no .proto source"


def test_generated_modules_import_as_protocol_pb():
    code = (
        "import protocol.pb.worker_pb2 as w, protocol.pb.internal_pb2 as i;"
        "assert w.DESCRIPTOR.package == 'llmariner.inference.server.v1';"
        "print(w.DESCRIPTOR.services_by_name['InferenceWorkerService'].methods_by_name['ProcessTasks'].full_name);"
        "print(i.DESCRIPTOR.services_by_name['InferenceInternalService'].methods_by_name['ProcessTasksInternal'].full_name)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == [
        "llmariner.inference.server.v1.InferenceWorkerService.ProcessTasks",
        "llmariner.inference.server.v1.InferenceInternalService.ProcessTasksInternal",
    ]
