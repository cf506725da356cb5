#!/usr/bin/env python
"""What one open stream costs the gateway, by allocation site: tracemalloc snapshots diffed.

The gateway (:func:`infx.service.build_gateway`) runs in this process under
``tracemalloc``; the paced engine and the slow clients of
``open_streams.py`` run as their own processes. After a warm-up round, a
snapshot is taken with no stream open, then ``--streams`` streams are
opened (tokens every ``--token-interval`` ms, slow by default so the
figure is what an open stream holds, not what is in flight), and a second
snapshot is taken once the gateway holds every one of them. The
difference, grouped by source line (and the biggest by traceback), divided
by the streams, is each site's cost per stream. tracemalloc sees Python's
allocator only: memory that C extensions take from ``malloc`` directly
(protobuf's upb arenas) shows in the RSS figure printed beside it.

    .venv/bin/python tools/bench/stream_memory.py [--streams 1000] [--top 30]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

from open_streams import HERE as BENCH, Child, free_port, parse_interval, vm_rss, wait_for_model  # noqa: E402


def clients(port: int, logs: Path, streams: int, ramp: float, until: float, tag: str) -> Child:
    now = time.monotonic()
    return Child(f"clients-{tag}", [
        sys.executable, str(BENCH / "open_streams_clients.py"), "--port", str(port), "--streams", str(streams),
        "--start-at", repr(now), "--ramp", repr(ramp), "--until", repr(until), "--window-start", repr(now),
        "--window-end", repr(now), "--deadline", repr(until + 30)], logs, piped=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--token-interval", type=parse_interval, default=(1.0, 2.0))
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--frames", type=int, default=8, help="traceback depth kept by tracemalloc")
    parser.add_argument("--rss-only", action="store_true",
                        help="no tracemalloc (it inflates RSS): only RSS per stream, as open_streams.py measures it")
    options = parser.parse_args(argv)

    from twisted.internet import reactor, threads

    from infx.config import GatewayConfig
    from infx.service import build_gateway

    http, worker = free_port(), free_port()
    config = GatewayConfig(http=f"tcp:{http}:interface=127.0.0.1:backlog=4096",
                           worker_grpc=f"tcp:{worker}:interface=127.0.0.1",
                           internal_grpc=f"tcp:{free_port()}:interface=127.0.0.1", grace_period=1.0)
    gateway_service = build_gateway(reactor, config)
    gateway = gateway_service.gateway
    if not options.rss_only:
        tracemalloc.start(options.frames)
    outcome: dict[str, Any] = {}

    def in_reactor(f: Any) -> Any:
        return threads.blockingCallFromThread(reactor, f)

    def snapshot() -> tuple[tracemalloc.Snapshot | None, int]:
        def take() -> tuple[tracemalloc.Snapshot | None, int]:
            gc.collect()
            return (None if options.rss_only else tracemalloc.take_snapshot()), vm_rss(os.getpid())
        result: tuple[tracemalloc.Snapshot | None, int] = in_reactor(take)
        return result

    def drive(logs: Path) -> None:
        engine = Child("engine", [
            sys.executable, str(BENCH / "open_streams_engine.py"), "--port", str(worker), "--engine-id", "mem",
            "--max-concurrency", str(options.streams + 100), "--min-interval", str(options.token_interval[0]),
            "--max-interval", str(options.token_interval[1])], logs)
        try:
            wait_for_model(http, [engine])
            warm = clients(http, logs, 20, 0.1, time.monotonic() + 1.0, "warmup")
            warm.process.communicate(timeout=60)
            warm.stop()
            time.sleep(0.5)
            before, rss_before = snapshot()
            ramp = max(1.0, options.streams / 500)
            hold_until = time.monotonic() + ramp + 150
            load = clients(http, logs, options.streams, ramp, hold_until, "main")
            deadline = time.monotonic() + ramp + 120
            while in_reactor(lambda: sum(1 for c in gateway.active_calls if c.sse_started)) < options.streams:
                if time.monotonic() > deadline or load.process.poll() is not None:
                    outcome["error"] = f"only {in_reactor(lambda: len(gateway.active_calls))} streams opened"
                    return
                time.sleep(0.2)
            time.sleep(1.0)
            after, rss_after = snapshot()
            outcome.update(before=before, after=after, rss=(rss_before, rss_after))
            load.stop()
        finally:
            engine.stop()
            reactor.callFromThread(reactor.stop)

    with tempfile.TemporaryDirectory(prefix="stream_memory-") as tmp:
        reactor.callWhenRunning(gateway_service.startService)
        reactor.callWhenRunning(lambda: threading.Thread(target=drive, args=(Path(tmp),), daemon=True).start())
        reactor.run()
    if "error" in outcome or "after" not in outcome:
        print(f"error: {outcome.get('error', 'no snapshot')}", file=sys.stderr)
        return 1
    rss_before, rss_after = outcome["rss"]
    if options.rss_only:
        print(f"{options.streams} open streams: RSS +{(rss_after - rss_before) / options.streams:,.0f} B per stream")
    else:
        report(outcome["before"], outcome["after"], outcome["rss"], options.streams, options.top)
    return 0


def report(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, rss: tuple[int, int], streams: int,
           top: int) -> None:
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    before, after = before.filter_traces(ignore), after.filter_traces(ignore)
    by_line = after.compare_to(before, "lineno")
    total = sum(stat.size_diff for stat in by_line)
    print(f"{streams} open streams: traced +{total / streams:,.0f} B per stream; "
          f"RSS +{(rss[1] - rss[0]) / streams:,.0f} B per stream (tracemalloc's own bookkeeping included)")
    print(f"\ntop {top} source lines, bytes and blocks per stream:")
    for stat in by_line[:top]:
        frame = stat.traceback[0]
        print(f"  {stat.size_diff / streams:8,.0f} B {stat.count_diff / streams:6.2f}  "
              f"{_short(frame.filename)}:{frame.lineno}")
    by_file = after.compare_to(before, "filename")
    print("\nby file, bytes per stream:")
    for stat in by_file[:top]:
        name = _short(stat.traceback[0].filename)
        print(f"  {stat.size_diff / streams:8,.0f} B {stat.count_diff / streams:6.2f}  {name}")
    print("\ntop 8 tracebacks:")
    for stat in after.compare_to(before, "traceback")[:8]:
        print(f"  {stat.size_diff / streams:,.0f} B per stream, {stat.count_diff / streams:.2f} blocks")
        for frame in stat.traceback.format(limit=6, most_recent_first=True):
            print(f"      {frame.strip()}")


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path.replace(str(HERE.parent.parent) + "/", "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
