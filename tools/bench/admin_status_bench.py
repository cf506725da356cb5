"""What /admin/status and the operator page cost a gateway: building the document, and journalling requests.

The production parts, no I/O: a ``Processor`` with ``--engines`` engines (each
with its runtime's load) spread over ``--tenants`` tenants and ``--models``
models, ``--waiting`` tasks waiting, a ``GatewayCore`` over it, and a
``RequestJournal`` that ``--requests`` requests ended in (a tenth of them
failures). Timed: ``ClusterStatus.status()`` plus its JSON (what
``/admin/status`` and each ``/admin/events`` event do), for every tenant and
for one tenant's admin; and ``RequestJournal.ended`` alone (what every
request pays when it ends).

Usage: ``python tools/bench/admin_status_bench.py [--engines 300] [--tenants 3] [--models 30]
[--waiting 1000] [--requests 2000] [--json]``
"""

from __future__ import annotations

import argparse
import json
import random
import time

from twisted.internet.task import Clock

from infx.gateway.cluster_status import ClusterStatus, RequestJournal, StatusSources
from protocol.gateway.core import GatewayCore
from protocol.gateway.effects import CoreConfig
from protocol.gateway.recent import RequestRecord
from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import Locality, Processor, ProcessorConfig


def build(engines: int, tenants: int, models: int, waiting: int) -> Processor:
    processor = Processor(ProcessorConfig(max_in_flight_per_engine=4))
    for i in range(engines):
        status = status_pb2.EngineStatus(engine_id=f"e{i}", ready=True)
        model = status.models.add(id=f"m{i % models}", is_ready=True, in_progress_task_count=2)
        model.runtime_load.running_requests = 3
        model.runtime_load.waiting_requests = 1
        model.runtime_load.kv_cache_usage = 0.5
        model.runtime_load.source = "vllm"
        status.infx_runtime.kind = "vllm"
        status.infx_runtime.version = "0.11.0"
        processor.update_engine(("route", i), f"t{i % tenants}", status, Locality.LOCAL, 0.0)
    request = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="nobody"))
    for n in range(waiting):
        processor.submit(task_id=f"w{n}", tenant_id=f"t{n % tenants}", request=request, origin="o", now=0.0)
    return processor


def record(n: int, rng: random.Random) -> RequestRecord:
    failed = n % 10 == 0
    return RequestRecord(request_id=f"r{n}", tenant=f"t{n % 3}", endpoint="chat/completions", model=f"m{n % 30}",
                         started_at=n * 0.01, ended_at=n * 0.01 + 0.5, status=502 if failed else 200,
                         error="engine_lost" if failed else "", served_by="gw-b", engine_id=f"e{n % 300}@gw-b",
                         queued_seconds=0.01, first_token_seconds=rng.random(), tokens_in=50, tokens_out=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=300)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--models", type=int, default=30)
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(1)
    processor = build(args.engines, args.tenants, args.models, args.waiting)
    core = GatewayCore(processor, CoreConfig(pod_name="gw-a"), random.Random(1))
    journal = RequestJournal()
    ended = [(record(n, rng), f"m{n % 30}") for n in range(args.requests)]
    started = time.perf_counter()
    for one, label in ended:
        journal.ended(one, label)
    per_request_us = (time.perf_counter() - started) / args.requests * 1e6
    clock = Clock()
    clock.advance(args.requests * 0.01 + 1)
    status = ClusterStatus(clock, StatusSources(
        core=core, gateway_of=lambda route: "gw-a", journal=journal, version="bench", started_at=0.0,
        address=lambda: "127.0.0.1:8083", ready=lambda: True, draining=lambda: False,
        max_in_flight_per_engine=4, routing_policy="affinity"))
    rows = []
    for scope in (None, "t0"):
        runs = 20
        started = time.perf_counter()
        for _ in range(runs):
            body = json.dumps(status.status(scope), sort_keys=True, default=str)
        rows.append({"scope": scope or "cluster", "ms": round((time.perf_counter() - started) / runs * 1000, 2),
                     "bytes": len(body)})
    if args.json:
        print(json.dumps({"journal_us_per_request": round(per_request_us, 2), "status": rows}))
        return
    print(f"{args.engines} engines, {args.tenants} tenants, {args.models} models, {args.waiting} waiting, "
          f"{args.requests} requests journalled")
    print(f"journal: {per_request_us:.1f} µs per request ended")
    for row in rows:
        print(f"status for {row['scope']}: {row['ms']} ms, {row['bytes']:,} bytes of JSON")


if __name__ == "__main__":
    main()
