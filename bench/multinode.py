#!/usr/bin/env python3
"""hotloop-serve on a Ray cluster of several nodes, one of them lost mid-conversation.

The cluster is simulated on this machine with ``ray.cluster_utils.Cluster``: a head node with
no CPUs for replicas (it runs Serve's controller and the one gRPC proxy), and worker nodes of
one CPU each, so the model's two replicas land on two different nodes. Then:

1. every session takes a turn (each owned by one of the two replicas);
2. the node of the first session's owner is removed without warning (a lost VM or pod:
   nothing runs on it after, so nothing is handed over), and Serve notices;
3. every session takes a turn: the SDK retries, and the sessions of the lost node are rebuilt
   from their history on the surviving replica, their runner-up;
4. a node joins, Serve starts the replacement replica there (it inherits the lost rank);
5. every session takes a turn: the replacement fetches the moved sessions from the runner-up.

It prints, for each step, turns that failed, sessions that changed replica, their share of
follow-up prompt tokens served from a cache and their median TTFT against the same run's hot
follow-ups, and writes ``bench/results/multinode.json``. ``tests/integration/test_multinode.py``
runs it small and checks that no turn was lost.

Run: ``.venv/bin/python bench/multinode.py [--sessions 6] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP = "multinode"


@dataclass
class Turn:
    session: int
    step: str
    replica: str
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    error: str = ""


def replica_nodes() -> dict[str, str]:
    """Running replica id -> the node it runs on, from Serve's controller."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    out: dict[str, str] = {}
    for dep in details["applications"][APP]["deployments"].values():
        for r in dep["replicas"]:
            if str(r["state"]).endswith("RUNNING"):
                out[str(r["replica_id"])] = str(r["node_id"])
    return out


def wait_running(n: int, timeout_s: float = 180) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = replica_nodes()
        if len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} of {n} replicas running after {timeout_s:.0f} s")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--sample-len", type=int, default=12)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "multinode.json")
    ns = ap.parse_args()

    from hotloop_client import Client, Message, Role, Settings
    from ray.cluster_utils import Cluster

    from hotloop_serve.config import config_from_dict
    from hotloop_serve.serve.probe import free_port, wait_until_serving
    from hotloop_serve.serve.runner import RAY_SERVE_ENV, start_server, stop_server

    for name, value in RAY_SERVE_ENV.items():  # before the head starts: its controller inherits them
        os.environ.setdefault(name, value)
    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    port = free_port()
    engine = {"context_tokens": 8192, "session_context_tokens": 2048, "hot_sessions": 8, "threads": 1}
    config = config_from_dict(
        {
            "server": {"grpc_port": port, "http_port": free_port()},
            "telemetry": {"enabled": False},
            "models": [{"name": APP, "replicas": 2, "engine": engine, "resources": {"num_cpus": 1}}],
        }
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    turns: list[Turn] = []
    facts: dict[str, Any] = {}
    try:
        start_server(config, address=cluster.address, proxy_location="HeadOnly")
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, [APP], timeout_s=300)
        nodes = wait_running(2)
        facts["nodes_of_replicas"] = len(set(nodes.values()))
        settings = Settings(temperature=0, sample_len=ns.sample_len)
        with Client(address) as client:
            model = client.model(APP)
            sessions = [model.new_session(settings=settings) for _ in range(ns.sessions)]
            histories = [[Message(Role.SYSTEM, f"You are assistant number {i}.")] for i in range(ns.sessions)]

            def step(name: str, text: str) -> None:
                for i, (s, h) in enumerate(zip(sessions, histories, strict=True)):
                    t0 = time.perf_counter()
                    ttft = 0.0
                    parts: list[str] = []
                    try:
                        for chunk in s.generate([*h, Message(Role.USER, f"{text} ({i})")]):
                            ttft = ttft or time.perf_counter() - t0
                            parts.append(chunk.text)
                        final = chunk
                    except Exception as e:
                        turns.append(Turn(i, name, "", 0.0, 0, 0, repr(e)[:200]))
                        continue
                    h += [Message(Role.USER, f"{text} ({i})"), Message(Role.ASSISTANT, "".join(parts))]
                    u, by = final.usage, final.served_by
                    assert u is not None and by is not None
                    turns.append(Turn(i, name, by.replica, ttft, u.prompt_tokens, u.cached_tokens + u.restored_tokens))

            step("1. before", "Hello, who are you?")
            step("1b. hot follow-up", "Tell me one fact.")
            owners = {t.session: t.replica for t in turns if t.step == "1b. hot follow-up"}
            lost_node = nodes[owners[0]]
            victim = next(w for w in workers if w.node_id == lost_node)
            facts["sessions_on_lost_node"] = sum(nodes.get(r) == lost_node for r in owners.values())
            cluster.remove_node(victim, allow_graceful=False)
            t0 = time.monotonic()
            while lost_node in replica_nodes().values():  # until Serve notices (its processes linger)
                if time.monotonic() - t0 > 120:
                    raise TimeoutError("Serve did not notice the lost node in 120 s")
                time.sleep(0.2)
            facts["loss_noticed_s"] = time.monotonic() - t0
            step("2. node lost", "Go on.")
            workers.append(cluster.add_node(num_cpus=1))
            t0 = time.monotonic()
            wait_running(2)
            facts["replacement_s"] = time.monotonic() - t0
            time.sleep(2)  # the routers hear of the replacement
            step("3. node replaced", "And then?")
            for s in sessions:
                s.close()
    finally:
        try:
            stop_server()
        finally:
            cluster.shutdown()
    report(turns, facts, ns.json)
    return 1 if any(t.error for t in turns) else 0


def report(turns: list[Turn], facts: dict[str, Any], path: Path) -> None:
    hot = [t.ttft_s for t in turns if t.step == "1b. hot follow-up" and not t.error]
    before = {t.session: t.replica for t in turns if t.step == "1b. hot follow-up"}
    print(f"\n{facts}\n")
    print("| step | turns failed | sessions moved | moved: prompt tokens from a cache | moved: TTFT median |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name in ("1b. hot follow-up", "2. node lost", "3. node replaced"):
        mine = [t for t in turns if t.step == name]
        moved = [t for t in mine if not t.error and t.replica != before.get(t.session)]
        share = sum(t.reused_tokens for t in moved) / max(1, sum(t.prompt_tokens for t in moved))
        ttft = statistics.median(t.ttft_s for t in moved) if moved else None
        rows.append(
            {
                "step": name,
                "failed": sum(bool(t.error) for t in mine),
                "moved": len(moved),
                "moved_cached_share": share if moved else None,
                "moved_ttft_s": ttft,
            }
        )
        ttft_txt = f"{ttft * 1e3:.0f} ms ({ttft / statistics.median(hot):.1f}x hot)" if ttft and hot else "-"
        share_txt = f"{100 * share:.0f}%" if moved else "-"
        print(f"| {name} | {rows[-1]['failed']} | {len(moved)} | {share_txt} | {ttft_txt} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"facts": facts, "rows": rows, "turns": [t.__dict__ for t in turns]}, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
