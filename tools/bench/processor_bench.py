"""Tasks per second through the pure processor alone: submit, dispatch, result, complete.

No I/O: the "engines" answer every SendTask at once with a 200 HttpResponse
(and, for the streaming case, a few server-sent events), and the client
acknowledges every delivered result. Scenarios:

- ``route``: one task at a time through 1, 10 or 100 engines (routing cost
  grows with the engines that serve the model);
- ``stream``: the same with 8 events per task (per-result cost);
- ``spread``: 1,000 engines of one tenant, 10 per model over 100 models,
  tasks for every model in turn (routing must cost the model's 10 engines,
  not all 1,000);
- ``backlog``: 10k tasks queued while no engine serves the model, then one
  engine joins and they are dispatched in one burst and completed.

Usage: ``python tools/bench/processor_bench.py [--tasks N] [--backlog N] [--json]``;
``--json`` prints one JSON object per scenario and line instead of a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

from protocol.pb import chat_pb2, status_pb2, worker_pb2
from protocol.processor.core import DeliverResult, Locality, Processor, ProcessorConfig, SendTask

EVENTS_PER_STREAM = 8


def _model(index: int, models: int) -> str:
    return "m" if models == 1 else f"m{index % models}"


def _engines(processor: Processor, count: int, models: int = 1) -> None:
    for i in range(count):
        status = status_pb2.EngineStatus(engine_id=f"e{i}", ready=True)
        status.models.add(id=_model(i, models), is_ready=True)
        processor.update_engine(f"route-e{i}", "tenant", status, Locality.LOCAL, 0.0)


def _results(task_id: str, streaming: bool) -> Iterator[worker_pb2.TaskResult]:
    yield worker_pb2.TaskResult(task_id=task_id, http_response=worker_pb2.HttpResponse(status_code=200, body=b"{}"))
    if streaming:
        for index in range(1, EVENTS_PER_STREAM + 1):
            event = worker_pb2.ServerSentEvent(data=b"data: {}\n\n", is_last_event=index == EVENTS_PER_STREAM)
            yield worker_pb2.TaskResult(task_id=task_id, result_index=index, server_sent_event=event)


def _answer(processor: Processor, sends: list[SendTask], streaming: bool, now: float) -> int:
    """Play the engines: answer every task; returns how many requests completed."""
    completed = 0
    for send in sends:
        for result in _results(send.task.id, streaming):
            for effect in processor.receive_result(send.route, result, now):
                assert isinstance(effect, DeliverResult), effect
                processor.results_consumed(send.task.id)
                completed += effect.last
    return completed


def run_route(engines: int, tasks: int, streaming: bool, models: int = 1) -> dict[str, object]:
    processor = Processor()
    _engines(processor, engines, models)
    requests = [worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(
        model=_model(m, models), stream=streaming)) for m in range(models)]
    completed = 0
    start = time.perf_counter()
    for i in range(tasks):
        now = i * 1e-3
        request = requests[i % models]
        effects = processor.submit(task_id=f"task-{i}", tenant_id="tenant", request=request, origin=None, now=now)
        completed += _answer(processor, [e for e in effects if isinstance(e, SendTask)], streaming, now)
    elapsed = time.perf_counter() - start
    assert completed == tasks, (completed, tasks)
    return _record("spread" if models > 1 else "stream" if streaming else "route", engines, tasks, elapsed)


def run_backlog(tasks: int) -> dict[str, object]:
    processor = Processor(ProcessorConfig(max_waiting_tasks=tasks))
    request = worker_pb2.TaskRequest(chat_completion=chat_pb2.CreateChatCompletionRequest(model="m"))
    start = time.perf_counter()
    for i in range(tasks):
        processor.submit(task_id=f"task-{i}", tenant_id="tenant", request=request, origin=None, now=0.0)
    status = status_pb2.EngineStatus(engine_id="e0", ready=True)
    status.models.add(id="m", is_ready=True)
    burst = time.perf_counter()
    effects = processor.update_engine("route-e0", "tenant", status, Locality.LOCAL, 1.0)
    burst = time.perf_counter() - burst
    sends = [e for e in effects if isinstance(e, SendTask)]
    completed = _answer(processor, sends, False, 1.0)
    elapsed = time.perf_counter() - start
    assert completed == tasks, (completed, tasks)
    record = _record("backlog", 1, tasks, elapsed)
    record["dispatch_burst_s"] = round(burst, 4)
    return record


def _record(scenario: str, engines: int, tasks: int, elapsed: float) -> dict[str, object]:
    return {
        "scenario": scenario,
        "engines": engines,
        "tasks": tasks,
        "seconds": round(elapsed, 4),
        "tasks_per_s": round(tasks / elapsed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks per routing scenario")
    parser.add_argument("--backlog", type=int, default=10_000, help="tasks queued before an engine joins")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = parser.parse_args()
    records = [run_route(engines, args.tasks, streaming=False) for engines in (1, 10, 100)]
    records += [run_route(engines, args.tasks // 4, streaming=True) for engines in (1, 100)]
    records.append(run_route(1000, args.tasks, streaming=False, models=100))
    records.append(run_backlog(args.backlog))
    if args.json:
        for record in records:
            print(json.dumps(record))
        return
    print(f"{'scenario':<10}{'engines':>8}{'tasks':>9}{'seconds':>10}{'tasks/s':>10}")
    for r in records:
        print(f"{r['scenario']:<10}{r['engines']:>8}{r['tasks']:>9}{r['seconds']:>10}{r['tasks_per_s']:>10}")
    for r in records:
        if "dispatch_burst_s" in r:
            print(f"backlog: dispatching {r['tasks']} queued tasks on engine join took {r['dispatch_burst_s']} s")


if __name__ == "__main__":
    main()
