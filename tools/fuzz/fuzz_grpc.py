"""atheris target: the pure gRPC machine (protocol/grpc/connection.py) against a hostile peer.

Each input plays one connection: the first byte picks the machine's role
(server against a hostile client, or client against a hostile server), the
rest is the peer's frames, how the wire cuts them, the application's
commands and the passing of time. The promises checked are listed in
``tools/fuzz/drivers.py``; a broken one, or any exception, is a finding.

Run it with ``tools/fuzz/run grpc`` (see that script), or directly:
``python tools/fuzz/fuzz_grpc.py -max_total_time=300 CORPUS_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["protocol", "h2", "hpack", "hyperframe", "tools"]):
    from tools.fuzz.drivers import AtherisSource, GrpcClientDriver, GrpcServerDriver


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    source = AtherisSource(fdp)
    if source.flag():
        GrpcServerDriver(source).run()
    else:
        GrpcClientDriver(source).run()


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
