#!/usr/bin/env python3
"""Fleet benchmark: do sessions keep their caches when every replica is replaced?

One run, side by side: a model of 2 replicas serves N sessions one long first turn each;
then every replica is replaced (``serve.run`` of a changed app: a rolling upgrade, the
harshest fleet change short of losing a node). Each session's follow-up turn is then timed:
with hand-over on (leaving replicas send their caches to the next owners, joining ones fetch
on first use) and off (the follow-up re-prefills its history), against the same-run baseline
of a hot follow-up with no fleet change.

A fourth row scales instead of replacing: the model autoscales (min 1, max 2, short delays),
the sessions chat concurrently until Serve adds a replica (the sessions it now owns are
fetched on first use), then go idle until Serve removes one (it hands its sessions over);
each session's follow-up is then timed on the one replica left.

The last two rows change the replica count in place, 2 -> 3 then 3 -> 2 (the declarative
deploy ``hotloop-serve apply`` uses: the other replicas stay), and count the sessions whose
follow-up moved to another replica: fetched from the old owner on scale-out, handed over by
the leaving replica on scale-in.

Run: ``.venv/bin/python bench/fleet.py [--sessions 6] [--json bench/results/fleet.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hotloop_client import Client, Message, Role, Settings
from ray import serve

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.serve.app import model_app
from hotloop_serve.serve.probe import free_port, wait_until_serving
from hotloop_serve.serve.runner import start_server, stop_server

APP = "fleet"
HTTP_PORT = free_port()
"""One for the whole run: a config that differs in anything but its fleet fields rolls the replicas."""
GREEDY = Settings(temperature=0, sample_len=8, repeat_penalty=1.0)


def config(port: int, handover: bool, generation: int, replicas: int = 2) -> Config:
    return config_from_dict(
        {
            "server": {"grpc_port": port, "http_port": HTTP_PORT},
            "telemetry": {"enabled": False},
            "models": [
                {
                    "name": APP,
                    "replicas": replicas,
                    "engine": {"context_tokens": 8192, "session_context_tokens": 2048, "hot_sessions": 8,
                               "threads": 1, "seed": generation},
                    "resources": {"num_cpus": 0.5},
                    "handover": handover,
                    "graceful_shutdown_timeout_s": 30,
                }
            ],
        }
    )  # fmt: skip


AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 2,
               "downscale_delay_s": 8, "look_back_period_s": 6}  # fmt: skip
LOADED_AFTER_SCALE_OUT_S = 15


def running(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None:
        return 0
    states = status.deployments[app].replica_states
    others = sum(n for state, n in states.items() if not str(state).endswith("RUNNING"))
    return -1 if others else int(sum(states.values()))


def wait_replicas(app: str, n: int, timeout_s: float = 180) -> float:
    t0 = time.monotonic()
    while running(app) != n:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{app}: not {n} replicas after {timeout_s} s")
        time.sleep(0.5)
    return time.monotonic() - t0


def autoscaled(address: str, port: int, sessions: int) -> dict[str, Any]:
    """Out under concurrent load, in when idle; then one timed follow-up per session."""
    cfg = config(port, True, 1)
    model = cfg.models[0].model_copy(update={"replicas": 1, "autoscaling": AUTOSCALING})
    cfg = cfg.model_copy(update={"models": [model]})
    cfg = config_from_dict(cfg.model_dump(mode="json"))  # validate the autoscaling block
    serve.run(model_app(cfg, cfg.models[0], os.environ["HOTLOOP_SESSION_SECRET"]), name=APP, route_prefix=f"/{APP}")
    wait_replicas(APP, 1)
    failures: list[BaseException] = []
    stop = threading.Event()
    with Client(address) as client:
        ss = [client.model(APP).new_session(settings=GREEDY) for _ in range(sessions)]
        transcripts = [list(history(i)) for i in range(sessions)]

        def turn(i: int, text: str | None) -> Any:
            if text is not None:
                transcripts[i].append(Message(Role.USER, text))
            chunks = list(ss[i].generate(transcripts[i]))
            transcripts[i].append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
            return chunks[-1]

        def drive(i: int) -> None:
            try:
                turn(i, None)
                n = 0
                while not stop.is_set():
                    n += 1
                    turn(i, f"Question {n}: name one boat.")
            except BaseException as e:
                failures.append(e)

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(sessions)]
        for t in threads:
            t.start()
        out_s = wait_replicas(APP, 2)
        time.sleep(LOADED_AFTER_SCALE_OUT_S)
        stop.set()
        for t in threads:
            t.join()
        in_s = wait_replicas(APP, 1)
        shares, ttft = [], []
        for i in range(sessions):
            last = turn(i, "Which items are boats?")
            assert last.usage and last.timings
            shares.append((last.usage.cached_tokens + last.usage.restored_tokens) / last.usage.prompt_tokens)
            ttft.append(last.timings.time_to_first_token_ms)
    serve.delete(APP)
    print(
        f"autoscaled: out after {out_s:.0f} s of load, in {in_s:.0f} s after it stopped, {len(failures)} failed turns"
    )
    return {
        "cached_share": shares,
        "ttft_ms": ttft,
        "scale_out_s": out_s,
        "scale_in_s": in_s,
        "failed_turns": len(failures),
    }


def scaled(address: str, port: int, sessions: int) -> dict[str, dict[str, Any]]:
    """2 -> 3 -> 2 replicas changed in place (as ``hotloop-serve apply`` does): after each
    change, every session's follow-up, counted for the sessions whose turn moved replica."""
    from hotloop_serve.serve.declarative import deploy

    deploy(config(port, True, 1, replicas=2))
    rows: dict[str, dict[str, Any]] = {}
    with Client(address) as client:
        ss = [client.model(APP).new_session(settings=GREEDY) for _ in range(sessions)]
        transcripts = [list(history(i)) for i in range(sessions)]
        owners: list[str] = []
        for i, s in enumerate(ss):
            chunks = list(s.generate(transcripts[i]))
            transcripts[i].append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
            assert chunks[-1].served_by
            owners.append(chunks[-1].served_by.replica)
        for label, n in (("scale-out 2 -> 3 in place, sessions that moved", 3),
                         ("scale-in 3 -> 2 in place, sessions that moved", 2)):  # fmt: skip
            deploy(config(port, True, 1, replicas=n))
            time.sleep(3)  # the routers hear of the change
            shares, ttft, turns = [], [], []
            for i, s in enumerate(ss):
                transcripts[i].append(Message(Role.USER, f"Question {n}: which items are boats?"))
                chunks = list(s.generate(transcripts[i]))
                transcripts[i].append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
                last = chunks[-1]
                assert last.usage and last.timings and last.served_by
                turns.append({"session": i, "from": owners[i], "to": last.served_by.replica,
                              "prompt": last.usage.prompt_tokens, "cached": last.usage.cached_tokens,
                              "restored": last.usage.restored_tokens})  # fmt: skip
                if last.served_by.replica != owners[i]:
                    shares.append((last.usage.cached_tokens + last.usage.restored_tokens) / last.usage.prompt_tokens)
                    ttft.append(last.timings.time_to_first_token_ms)
                owners[i] = last.served_by.replica
            rows[label] = {"cached_share": shares, "ttft_ms": ttft, "turns": turns}
    serve.delete(APP)
    return rows


def history(i: int) -> list[Message]:
    notes = " ".join(f"Item {j} of list {i} is a {['cat', 'boat', 'tree'][j % 3]}." for j in range(60))
    return [Message(Role.USER, f"Remember list {i}: {notes}")]


def run(address: str, port: int, sessions: int, handover: bool | None) -> dict[str, Any]:
    """handover None: no fleet change (the hot baseline)."""
    cfg = config(port, bool(handover), 1)
    serve.run(model_app(cfg, cfg.models[0], os.environ["HOTLOOP_SESSION_SECRET"]), name=APP, route_prefix=f"/{APP}")
    with Client(address) as client:
        ss = [client.model(APP).new_session(settings=GREEDY) for _ in range(sessions)]
        replies = ["".join(c.text for c in s.generate(history(i))) for i, s in enumerate(ss)]
        if handover is not None:
            cfg2 = config(port, handover, 2)
            serve.run(model_app(cfg2, cfg2.models[0], os.environ["HOTLOOP_SESSION_SECRET"]), name=APP,
                      route_prefix=f"/{APP}")  # fmt: skip
        shares, ttft = [], []
        for i, s in enumerate(ss):
            follow = [*history(i), Message(Role.ASSISTANT, replies[i]), Message(Role.USER, "Which items are boats?")]
            last = list(s.generate(follow))[-1]
            assert last.usage and last.timings
            shares.append((last.usage.cached_tokens + last.usage.restored_tokens) / last.usage.prompt_tokens)
            ttft.append(last.timings.time_to_first_token_ms)
    serve.delete(APP)
    return {"cached_share": shares, "ttft_ms": ttft}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument(
        "--rows",
        nargs="*",
        default=["replace", "autoscale", "scale"],
        choices=["replace", "autoscale", "scale"],
        help="which fleet changes to measure besides the hot baseline (default: all)",
    )
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "fleet.json")
    ns = ap.parse_args()
    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    port = free_port()
    address = f"127.0.0.1:{port}"
    base = config(port, True, 1)
    start_server(base, num_cpus=8)
    results: dict[str, Any] = {}
    try:
        wait_until_serving(address, [APP], timeout_s=300)
        serve.delete(APP)
        results["hot follow-up, no fleet change"] = run(address, port, ns.sessions, None)
        if "replace" in ns.rows:
            for label, mode in (("every replica replaced, hand-over on", True),
                                ("every replica replaced, hand-over off", False)):  # fmt: skip
                results[label] = run(address, port, ns.sessions, mode)
        if "autoscale" in ns.rows:
            results["autoscaled 1 -> 2 under load -> 1 when idle"] = autoscaled(address, port, ns.sessions)
        if "scale" in ns.rows:
            results.update(scaled(address, port, ns.sessions))
    finally:
        stop_server()
    hot = statistics.median(results["hot follow-up, no fleet change"]["ttft_ms"])
    print(f"\n{ns.sessions} sessions, 2 replicas\n")
    head = f"| {'event':<44} | {'sessions >= 90% cached':>22} | {'median cached':>13} |"
    print(head + f" {'median TTFT':>12} | {'vs hot':>7} |")
    print(f"|{'-' * 46}|{'-' * 24}|{'-' * 15}|{'-' * 14}|{'-' * 9}|")
    for label, r in results.items():
        if not r["cached_share"]:
            print(f"| {label:<44} | {'no session moved':>22} |")
            continue
        ok = sum(s >= 0.9 for s in r["cached_share"])
        med = statistics.median(r["ttft_ms"])
        share = statistics.median(r["cached_share"])
        print(f"| {label:<44} | {ok:>12} of {len(r['cached_share']):<7} | {share:>12.0%} ", end="")
        print(f"| {med:>9.0f} ms | {med / hot:>6.2f}x |")
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
