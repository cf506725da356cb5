"""``twistd infx --workers N``: real supervisor and worker processes on loopback.

What each test pins down: new connections spread over the workers (``SO_REUSEPORT``) and a
request on any worker is served by that worker's own in-process engine (the built-in one, or
its engine for a runtime by URL), never forwarded to a sibling; a dial-in engine attached to one worker serves requests arriving at every
worker (through the exchange); killing one worker loses no request on the other, and the
supervisor starts it again; SIGTERM drains every worker; ``/metrics`` holds every worker's
series; ``--workers 1`` is one process, as before.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from harness.recording_runtime import RecordingRuntime
from harness.twistd_processes import Gateway, TwistdChild, children_of, http_get, wait_until
from infx.gateway.runtime_engines import runtime_engine_id
from infx.service import builtin_engine_id
from tests.support.lossless import MODEL, chat_answer

pytestmark = pytest.mark.slow

REQUEST_LINE = re.compile(r"\[worker-(\d+) infx\.request_log#info\] request (\S+) .* status=200 .* "
                          r"engine='([^']*)' gateway='([^']*)'")


def chat(port: int, model: str = "echo", text: str = "hi", request_id: str | None = None,
         connection: http.client.HTTPConnection | None = None, stream: bool = False) -> tuple[int, bytes]:
    """One chat completion, on ``connection`` (kept open) or a new one (closed after)."""
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    headers = {"content-type": "application/json"}
    if request_id:
        headers["x-request-id"] = request_id
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        if connection is None:
            conn.close()


def served(gateway: Gateway) -> dict[str, tuple[int, str, str]]:
    """Each request answered 200: which worker took it, the engine that served it and that engine's gateway."""
    return {m.group(2): (int(m.group(1)), m.group(3), m.group(4))
            for m in REQUEST_LINE.finditer(gateway.child.output())}


def worker_pids(gateway: Gateway) -> dict[int, int]:
    """The pid of each worker's latest process, from the supervisor's log."""
    pids: dict[int, int] = {}
    for m in re.finditer(r"worker (\d+) started(?: again)? \(pid (\d+)\)", gateway.child.output()):
        pids[int(m.group(1))] = int(m.group(2))
    return pids


def all_listening(gateway: Gateway) -> bool:
    """Both workers listen, and where they run the built-in echo engine, it serves (it connects
    once its worker listens: a request before that is a 404, as with one process)."""
    said = gateway.child.output()
    echo = "--echo-models" in gateway.child.process.args
    return "all 2 workers listen" in said and (not echo or all(
        re.search(rf"\[worker-{i} infx\.workers#info\] engine builtin-echo-\S+ connected from", said) for i in (0, 1)))


def test_connections_spread_over_the_workers_and_each_serves_from_its_own_engine(tmp_path):
    gateway = Gateway(tmp_path, workers=2, extra=["--echo-models", "echo", "--echo-token-delay", "0"])
    try:
        wait_until(lambda: all_listening(gateway), "both workers to listen", [gateway.child])
        for i in range(40):
            status, body = chat(gateway.http_port, text=f"hello {i}", request_id=f"spread-{i}")
            assert status == 200 and f"hello {i}" in json.loads(body)["choices"][0]["message"]["content"]
        lines = wait_until(lambda: len(s := {k: v for k, v in served(gateway).items()
                                             if k.startswith("spread-")}) == 40 and s,
                           "40 request lines", [gateway.child])
        by_worker = {worker for worker, _, _ in lines.values()}
        assert by_worker == {0, 1}, "the kernel gave every new connection to one worker"
        for worker, engine, pod in lines.values():
            # Served by its own built-in engine: no request crossed to a sibling.
            assert pod == gateway.worker_pod_name(worker)
            assert engine == builtin_engine_id(gateway.worker_pod_name(worker))
        # One scrape on the shared port holds both workers' series.
        code, text = http_get(gateway.url + "/metrics")
        assert code == 200
        metrics = text.decode()
        assert "infx_workers_scraped 2.0" in metrics
        total = sum(float(m.group(1)) for m in re.finditer(
            r'^infx_http_requests_total\{[^}]*endpoint="chat/completions"[^}]*\} (\S+)$', metrics, re.M))
        assert total == 40
        assert 'worker="0"' in metrics and 'worker="1"' in metrics
    finally:
        gateway.stop()


def test_every_worker_sends_to_a_runtime_by_url_itself_never_through_a_sibling(tmp_path):
    runtime = RecordingRuntime(tmp_path)
    gateway = None
    try:
        runtime.script(*[chat_answer(f"answer {i}") for i in range(200)])
        gateway = Gateway(tmp_path, workers=2, extra=["--runtime-url", f"{runtime.url}={MODEL}"])
        name = runtime.url.removeprefix("http://")

        def both_serve() -> bool:
            # Each worker registers its own engine for the runtime once it has checked its health.
            chat(gateway.http_port, model=MODEL)
            return {worker for worker, _, _ in served(gateway).values()} == {0, 1}

        wait_until(both_serve, "both workers to serve the runtime by URL", [gateway.child])
        for i in range(40):
            status, _ = chat(gateway.http_port, model=MODEL, request_id=f"by-url-{i}")
            assert status == 200
        lines = wait_until(lambda: len(s := {k: v for k, v in served(gateway).items()
                                             if k.startswith("by-url-")}) == 40 and s,
                           "40 request lines", [gateway.child])
        assert {worker for worker, _, _ in lines.values()} == {0, 1}
        for worker, engine, pod in lines.values():
            # The worker's own engine for the runtime: the request went straight to it.
            assert (engine, pod) == (runtime_engine_id(name, gateway.worker_pod_name(worker)),
                                     gateway.worker_pod_name(worker))
    finally:
        for child in (gateway, runtime):
            if child is not None:
                child.stop()


def test_every_worker_homes_a_prompt_on_the_same_runtime_by_url(tmp_path):
    """Each worker has engines of its own for the runtimes by URL, named with its pod; both place
    each runtime at the same point of the affinity ring (by the runtime's name), so a prompt's
    requests reach one runtime whichever worker takes them."""
    runtimes = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runtimes.append(RecordingRuntime(tmp_path / name))
    gateway = None
    try:
        for runtime in runtimes:
            runtime.script(*[chat_answer(f"answer {i}") for i in range(200)])
        gateway = Gateway(tmp_path, workers=2,
                          extra=[arg for runtime in runtimes for arg in ("--runtime-url", f"{runtime.url}={MODEL}")])
        names = {runtime.url.removeprefix("http://"): runtime for runtime in runtimes}

        def ask(text: str, system: str = "", request_id: str | None = None) -> None:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=20)
            headers = {"content-type": "application/json", **({"x-request-id": request_id} if request_id else {})}
            try:
                conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": messages}),
                             headers)
                response = conn.getresponse()
                assert response.status == 200, response.read()
                response.read()
            finally:
                conn.close()

        warm = iter(range(10_000))

        def every_worker_serves_both() -> bool:
            # Each worker registers its engine for each runtime once it has checked the runtime's health.
            ask(f"warm {next(warm)}")
            return {(worker, engine) for worker, engine, _ in served(gateway).values()} == {
                (w, runtime_engine_id(name, gateway.worker_pod_name(w))) for w in (0, 1) for name in names}

        wait_until(every_worker_serves_both, "both workers to serve both runtimes", [gateway.child])
        for runtime in runtimes:
            runtime.reset()
            runtime.script(*[chat_answer(f"answer {i}") for i in range(200)])
        prompts = [f"You are assistant {n}. " + "Answer briefly and cite your sources. " * 20 for n in range(8)]
        for turn in range(5):
            for n, system in enumerate(prompts):
                ask(f"question {turn}", system, request_id=f"home-{n}-{turn}")
        lines = wait_until(lambda: len(s := {k: v for k, v in served(gateway).items()
                                             if k.startswith("home-")}) == 40 and s,
                           "40 request lines", [gateway.child])
        assert {worker for worker, _, _ in lines.values()} == {0, 1}
        reached: dict[str, set[str]] = {}
        for name, runtime in names.items():
            for recorded in runtime.requests():
                system = json.loads(recorded.body)["messages"][0]["content"]
                reached.setdefault(system, set()).add(name)
        assert len(reached) == len(prompts)
        assert all(len(where) == 1 for where in reached.values()), reached
    finally:
        for child in (gateway, *runtimes):
            if child is not None:
                child.stop()


def test_a_dial_in_engine_on_one_worker_serves_requests_arriving_at_the_other(tmp_path):
    gateway = Gateway(tmp_path, workers=2)
    engine = None
    try:
        wait_until(lambda: all_listening(gateway), "both workers to listen", [gateway.child])
        # Not harness.Engine: it waits on /admin/status, which answers for whichever worker takes it.
        engine = TwistdChild("engine-gpu-0", ["infx-engine", "--server", gateway.worker_address, "--engine-id",
                                              "gpu-0", "--runtime", "echo", "--models", "m", "--token-delay", "0"],
                             tmp_path)

        def every_worker_serves() -> bool:
            lines = served(gateway)
            return {w for rid, (w, _, _) in lines.items() if rid.startswith("probe-")} == {0, 1}

        def probe() -> bool:
            for i in range(6):
                status, _ = chat(gateway.http_port, model="m", request_id=f"probe-{time.monotonic_ns()}-{i}")
                if status != 200:
                    return False
            return every_worker_serves()

        wait_until(probe, "the engine to serve requests arriving at both workers", [gateway.child, engine])
        lines = {rid: v for rid, v in served(gateway).items() if rid.startswith("probe-")}
        attached = {pod for _, _, pod in lines.values()}
        assert len(attached) == 1, "one engine, attached to one worker"
        (home,) = attached
        for worker, engine_id, pod in lines.values():
            assert pod == home
            # At its own worker the engine is gpu-0; at the other, gpu-0@<its worker>, through the exchange.
            assert engine_id == ("gpu-0" if gateway.worker_pod_name(worker) == home else f"gpu-0@{home}")
    finally:
        if engine is not None:
            engine.stop()
        gateway.stop()


def test_killing_one_worker_loses_no_request_on_the_other_and_it_is_started_again(tmp_path):
    gateway = Gateway(tmp_path, workers=2, extra=["--echo-models", "echo", "--echo-token-delay", "0.02"])
    try:
        wait_until(lambda: all_listening(gateway), "both workers to listen", [gateway.child])
        # Persistent connections, each pinned to the worker that accepted it (its request log says which).
        connections: list[http.client.HTTPConnection] = []
        owner: dict[int, int] = {}

        def pin_both() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
            index = len(connections)
            connections.append(conn)
            assert chat(gateway.http_port, request_id=f"pin-{index}", connection=conn)[0] == 200
            line = wait_until(lambda: served(gateway).get(f"pin-{index}"), "its request line", [gateway.child])
            owner[index] = line[0]
            return set(owner.values()) == {0, 1}

        wait_until(pin_both, "connections on both workers", [gateway.child], timeout=60)
        victim = 0
        survivors = [i for i, w in owner.items() if w != victim]
        results: dict[int, list[int]] = {i: [] for i in survivors}
        stop = threading.Event()

        def keep_asking(index: int) -> None:
            conn = connections[index]
            n = 0
            while not stop.is_set():
                # Streams of a few words: some are in flight when the sibling dies.
                status, body = chat(gateway.http_port, text="one two three four five", connection=conn,
                                    request_id=f"live-{index}-{n}", stream=True)
                whole = status == 200 and body.rstrip().endswith(b"data: [DONE]")
                results[index].append(200 if whole else status)
                n += 1

        threads = [threading.Thread(target=keep_asking, args=(i,)) for i in survivors]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        os.kill(worker_pids(gateway)[victim], signal.SIGKILL)
        wait_until(lambda: "worker 0 was killed by a signal" in gateway.child.output(), "the supervisor to see it",
                   [gateway.child])
        wait_until(lambda: len(re.findall(r"worker 0 started again", gateway.child.output())) == 1
                   and gateway.child.output().count("[worker-0 infx.service#info] listening:") == 2,
                   "worker 0 to listen again", [gateway.child], timeout=60)
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        for index in survivors:
            assert results[index] and all(status == 200 for status in results[index]), results[index]
        # The restarted worker serves new connections.
        for i in range(20):
            assert chat(gateway.http_port, request_id=f"after-{i}")[0] == 200
        assert gateway.child.alive
    finally:
        for conn in connections:
            conn.close()
        gateway.stop()


def test_sigterm_drains_every_worker_and_the_supervisor_exits_cleanly(tmp_path):
    gateway = Gateway(tmp_path, workers=2, extra=["--echo-models", "echo", "--echo-token-delay", "0.05",
                                                  "--grace-period", "20"])
    try:
        wait_until(lambda: all_listening(gateway), "both workers to listen", [gateway.child])
        workers = children_of(gateway.child.process.pid)
        assert len(workers) == 2
        answers: list[tuple[int, bytes]] = []
        long_text = " ".join(f"w{i}" for i in range(40))  # 40 words at 0.05 s: 2 s of stream
        streams = [threading.Thread(target=lambda: answers.append(chat(gateway.http_port, text=long_text,
                                                                       stream=True)))
                   for _ in range(4)]
        for thread in streams:
            thread.start()
        time.sleep(0.5)
        gateway.child.signal(signal.SIGTERM)
        for thread in streams:
            thread.join(timeout=30)
        assert len(answers) == 4
        for status, body in answers:
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]") and b"w39" in body
        assert gateway.child.wait(timeout=40) in (0, -signal.SIGTERM)  # twistd re-raises the signal it stopped on
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        output = gateway.child.output()
        assert "stopping 2 workers" in output and "Server Shut Down." in output
    finally:
        gateway.stop()


def test_one_worker_is_one_process_as_before(tmp_path):
    gateway = Gateway(tmp_path, workers=1, extra=["--echo-models", "echo"])
    try:
        assert children_of(gateway.child.process.pid) == []
        assert chat(gateway.http_port)[0] == 200
        code, text = http_get(gateway.url + "/metrics")
        assert code == 200 and b"worker=" not in text and b"infx_workers_scraped" not in text
        assert "[worker-" not in gateway.child.output() and "infx.supervisor" not in gateway.child.output()
    finally:
        gateway.stop()


def test_a_daemonized_supervisor_writes_the_pidfile_logs_every_worker_to_its_logfile_and_stops_on_sigterm(tmp_path):
    """twistd without -n: the supervisor is the daemon (its pid in the pidfile), the workers' events
    reach its --logfile through it, and SIGTERM to that pid drains and ends them all."""
    import subprocess

    from harness.twistd_processes import TWISTD, ROOT, supervisor_ports

    pidfile, logfile = tmp_path / "infx.pid", tmp_path / "infx.log"
    # Port 0 everywhere, read back from the log: a daemon cannot be started again on other ports
    # if one picked for it were taken before it bound it.
    result = subprocess.run(
        [TWISTD, f"--pidfile={pidfile}", "--logfile", str(logfile), "infx", "--workers", "2",
         "--http", "tcp:0:interface=127.0.0.1", "--worker-grpc", "tcp:0:interface=127.0.0.1",
         "--internal-grpc", "tcp:0:interface=127.0.0.1", "--echo-models", "echo"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), "the pidfile"))
    try:
        http, _, _ = wait_until(lambda: supervisor_ports(logfile.read_text()), "the supervisor's ports")
        wait_until(lambda: (t := logfile.read_text()).count("infx.workers#info] engine builtin-echo-") == 2
                   and "all 2 workers listen" in t, "both workers to listen and serve echo")
        workers = children_of(pid)
        assert len(workers) == 2
        for i in range(10):
            assert chat(http, request_id=f"daemon-{i}")[0] == 200
        text = wait_until(lambda: (t := logfile.read_text()).count("infx.request_log#info] request daemon-") == 10
                          and t, "the request lines in the logfile")
        assert "[worker-0 infx.service#info] listening:" in text and "[worker-1 infx.service#info] listening:" in text
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not Path(f"/proc/{pid}").exists() and not any(Path(f"/proc/{w}").exists()
                                                                          for w in workers),
                   "the supervisor and its workers to exit", timeout=40)
        assert not pidfile.exists()
    finally:
        for p in [pid, *children_of(pid)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_every_worker_of_a_peer_is_dialled_from_one_port_in_peers(tmp_path):
    """A lists one port of B; B lists nothing. A's workers learn B's other worker from B's headers,
    B's workers dial A's back: an engine on either worker of B serves requests at both workers of A."""
    b = Gateway(tmp_path, workers=2, name="b")
    a = None
    engine = None
    try:
        a = Gateway(tmp_path, workers=2, name="a", extra=["--peers", f"127.0.0.1:{b.internal_port}"])
        wait_until(lambda: all_listening(a) and all_listening(b), "both gateways' workers to listen",
                   [a.child, b.child])
        engine = TwistdChild("engine-gpu-0", ["infx-engine", "--server", b.worker_address, "--engine-id", "gpu-0",
                                              "--runtime", "echo", "--models", "m", "--token-delay", "0"], tmp_path)

        def probe() -> bool:
            for i in range(6):
                if chat(a.http_port, model="m", request_id=f"via-a-{time.monotonic_ns()}-{i}")[0] != 200:
                    return False
            return {w for rid, (w, _, _) in served(a).items() if rid.startswith("via-a-")} == {0, 1}

        wait_until(probe, "both workers of a to serve b's engine", [a.child, b.child, engine], timeout=60)
        b_pods = {b.worker_pod_name(0), b.worker_pod_name(1)}
        for rid, (_, engine_id, pod) in served(a).items():
            if rid.startswith("via-a-"):
                assert pod in b_pods and engine_id == f"gpu-0@{pod}"
        # Every worker of a dialled every worker of b (one of b's ports came from its headers).
        said = a.child.output()
        for worker in (0, 1):
            for port in b.internal_ports:
                assert re.search(rf"\[worker-{worker} infx\.exchanger#info\] peer \S+: connected at 127\.0\.0\.1:{port}",
                                 said), (worker, port)
    finally:
        for child in (engine, a.child if a else None, b.child):
            if child is not None:
                child.stop()


def test_workers_whose_supervisor_is_killed_drain_and_exit(tmp_path):
    """SIGKILL leaves the supervisor no word: its workers see their standard input end, drain
    (an answer already under way is finished) and exit, rather than serve on unwatched."""
    gateway = Gateway(tmp_path, workers=2, extra=["--echo-models", "echo", "--echo-token-delay", "0.05",
                                                  "--grace-period", "10"])
    workers: list[int] = []
    try:
        wait_until(lambda: all_listening(gateway), "both workers to listen", [gateway.child])
        workers = children_of(gateway.child.process.pid)
        answers: list[tuple[int, bytes]] = []
        stream = threading.Thread(target=lambda: answers.append(
            chat(gateway.http_port, text=" ".join(f"w{i}" for i in range(30)), stream=True)))
        stream.start()
        time.sleep(0.5)
        gateway.child.kill()
        stream.join(timeout=30)
        assert answers and answers[0][0] == 200 and answers[0][1].rstrip().endswith(b"data: [DONE]")
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() and "zombie" not in
                                   Path(f"/proc/{pid}/status").read_text().lower() for pid in workers),
                   "the orphaned workers to exit", timeout=30)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gateway.stop()
