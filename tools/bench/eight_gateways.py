"""Eight gateways, sixteen engines: exchange latency, requests lost and convergence after a restart.

The cluster of ``tests/e2e/test_eight_gateways.py`` (:mod:`harness.eight_gateways`): 8 ``twistd infx``
gateways on loopback in a full mesh of static peers, 16 echo engines (no token delay), 4 models
each on 4 engines of 4 gateways. It measures, in one run:

1. Latency of one non-streaming chat request at each gateway, alternating a model its own
   engines serve (local) and one only its peers' engines serve (through the exchange), over one
   keep-alive connection per gateway, so both see the same machine load. The gateways route
   ``least_in_progress`` by default here (local engines first); with ``affinity`` a request for
   a local model may go to a peer's engine, which blurs the comparison.
2. With the openai client's steady traffic from every gateway, one gateway is SIGKILLed, left
   down for ``--down`` seconds and restarted on its ports: requests to live gateways that did not
   get their right answer (lost; should be 0), requests to the dead one (connection errors), and
   how long the cluster took to converge after the restart: until the restarted gateway listens,
   until it sees its peers' engines (the exchange), and until every gateway sees the restarted
   gateway's own engines again (their reconnect backoff).

Run: ``.venv/bin/python tools/bench/eight_gateways.py [--requests N] [--down S] [--json]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.eight_gateways import (  # noqa: E402 (the checkout goes on the path first)
    ALL_ENGINES,
    ENGINES_PER_GATEWAY,
    HOSTS,
    MODELS,
    EightGateways,
    GatewayNode,
    Traffic,
    cut_on_a_lost_engine,
    engine_id,
)

VICTIM = 3


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def exchange_latency(cluster: EightGateways, rounds: int) -> dict[str, Any]:
    """Milliseconds per request, local model vs a model served only through a peer, alternating."""
    samples: dict[str, list[float]] = {"local": [], "peer": []}
    connections = {node.index: http.client.HTTPConnection(node.host, node.http_port, timeout=10)
                   for node in cluster.gateways}
    for round_ in range(rounds):
        for node in cluster.gateways:
            local = sorted(node.local_models())
            remote = sorted(set(MODELS) - node.local_models())
            pair = [("local", local[round_ % len(local)]), ("peer", remote[round_ % len(remote)])]
            # Which goes first alternates: the first request after a gateway sat idle is slower.
            for kind, model in pair if round_ % 2 == 0 else pair[::-1]:
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello infx world"}]})
                connection = connections[node.index]
                began = time.perf_counter()
                connection.request("POST", "/v1/chat/completions", body=body,
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                elapsed = time.perf_counter() - began
                if response.status != 200 or b"hello infx world" not in data:
                    raise AssertionError(f"{node.name} {model}: {response.status} {data[:200]!r}")
                if round_ >= 5:  # warm-up rounds are not counted
                    samples[kind].append(elapsed * 1000)
    for connection in connections.values():
        connection.close()
    out: dict[str, Any] = {}
    for kind, values in samples.items():
        out[kind] = {"requests": len(values), "p50_ms": round(statistics.median(values), 3),
                     "p99_ms": round(_percentile(values, 0.99), 3)}
    out["added_p50_ms"] = round(out["peer"]["p50_ms"] - out["local"]["p50_ms"], 3)
    return out


def _sees_all(node: GatewayNode, engines: set[str]) -> bool:
    try:
        return engines <= node.ready_engines()
    except (OSError, AssertionError):
        return False


def kill_and_restart(cluster: EightGateways, down: float) -> dict[str, Any]:
    """Steady traffic; SIGKILL one gateway, restart it after ``down`` seconds; time the convergence."""
    victim = cluster.gateways[VICTIM]
    live = [node for node in cluster.gateways if node is not victim]
    own = {engine_id(VICTIM, s) for s in range(ENGINES_PER_GATEWAY)}
    everyone = {node.index for node in cluster.gateways}
    traffic = Traffic(cluster, per_gateway=2).start()
    try:
        traffic.wait_answered(everyone, 0.0)
        killed_at = time.monotonic()
        cluster.kill(victim)
        time.sleep(down)
        restarted_at = time.monotonic()
        cluster.restart(victim)
        ready_at = time.monotonic()
        peers_seen = engines_back = None
        while peers_seen is None or engines_back is None:
            now = time.monotonic()
            if now - ready_at > 120:
                raise AssertionError(f"no convergence in 120 s: {cluster.missing()}")
            if peers_seen is None and _sees_all(victim, set(ALL_ENGINES) - own):
                peers_seen = now - ready_at
            if engines_back is None and all(_sees_all(node, own) for node in cluster.gateways):
                engines_back = now - ready_at
            time.sleep(0.02)
        converged_at = time.monotonic()
        traffic.wait_answered(everyone, converged_at)
    finally:
        outcomes = traffic.stop()
    to_live = [o for o in outcomes if o.gateway != VICTIM]
    to_victim = [o for o in outcomes if o.gateway == VICTIM]
    cut = [o for o in to_live if cut_on_a_lost_engine(o, cluster.gateways[o.gateway], killed_at, own)]
    lost = [o for o in to_live if o.kind != "ok" and o not in cut]
    return {
        "requests": len(outcomes),
        "requests_to_live_gateways": len(to_live),
        "lost": len(lost),
        "lost_examples": [f"{o.kind}: {o.detail}" for o in lost[:5]],
        "streams_cut_on_a_lost_engine": len(cut),
        "to_killed_gateway": {kind: sum(1 for o in to_victim if o.kind == kind)
                              for kind in sorted({o.kind for o in to_victim})},
        "down_s": round(restarted_at - killed_at, 2),
        "restart_to_listening_s": round(ready_at - restarted_at, 2),
        "listening_to_peers_engines_seen_s": round(peers_seen, 2),
        "listening_to_own_engines_seen_everywhere_s": round(engines_back, 2),
        "listening_to_converged_s": round(max(peers_seen, engines_back), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="latency rounds (one local + one peer request "
                                                                  "per gateway each) [default: 200]")
    parser.add_argument("--down", type=float, default=2.0, help="seconds the killed gateway stays down [2]")
    parser.add_argument("--status-interval", type=float, default=1.0, help="gateways' and engines' [1]")
    parser.add_argument("--routing-policy", default="least_in_progress",
                        help="the gateways' --routing-policy [least_in_progress: local engines first, so that "
                             "'local' requests are served here; affinity may send them to a peer's engine]")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eight-gateways-") as logs:
        cluster = EightGateways(Path(logs), token_delay=0.0, status_interval=args.status_interval,
                                gateway_options=("--routing-policy", args.routing_policy))
        try:
            began = time.monotonic()
            cluster.start()
            figures: dict[str, Any] = {"hosts": f"{HOSTS[0]}..{HOSTS[-1]}", "routing_policy": args.routing_policy,
                                       "cluster_start_s": round(time.monotonic() - began, 2)}
            figures["latency"] = exchange_latency(cluster, args.requests + 5)
            figures["restart"] = kill_and_restart(cluster, args.down)
        finally:
            cluster.stop()
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0 if figures["restart"]["lost"] == 0 else 1
    latency, restart = figures["latency"], figures["restart"]
    print(f"8 gateways x 2 engines on {figures['hosts']}, --routing-policy {args.routing_policy}; "
          f"cluster up and converged in {figures['cluster_start_s']} s")
    print(f"latency, non-streaming, {latency['local']['requests']} requests each:")
    for kind in ("local", "peer"):
        print(f"  {kind:5}  p50 {latency[kind]['p50_ms']:7.3f} ms  p99 {latency[kind]['p99_ms']:7.3f} ms")
    print(f"  the exchange adds {latency['added_p50_ms']:.3f} ms at p50")
    print(f"kill -9 gateway g{VICTIM}, down {restart['down_s']} s, restarted on its ports:")
    print(f"  requests {restart['requests']} ({restart['requests_to_live_gateways']} to live gateways); "
          f"lost {restart['lost']}; streams cut on a lost engine {restart['streams_cut_on_a_lost_engine']}; "
          f"to the killed gateway {restart['to_killed_gateway']}")
    for example in restart["lost_examples"]:
        print(f"    lost: {example}")
    print(f"  restart to listening {restart['restart_to_listening_s']} s; then its peers' engines seen in "
          f"{restart['listening_to_peers_engines_seen_s']} s, its own engines seen everywhere in "
          f"{restart['listening_to_own_engines_seen_everywhere_s']} s (converged)")
    return 0 if restart["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
