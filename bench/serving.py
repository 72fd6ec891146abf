#!/usr/bin/env python3
"""The serving layer at accelerator token rates: the full stack over the synthetic engine.

An accelerator replica emits thousands of tokens per second across 64-256 sessions; llama.cpp
on this machine's 2 cores cannot. The synthetic engine (``engine.kind: synthetic``) can: each
step waits the step time and emits one token per running session, through the real engine's
scheduler and streams. This bench drives N concurrent streams of T tokens each through

- ``engine``: the engine in-process, read by one asyncio loop, no Ray (the same-run baseline:
  what the serving layer is offered),
- ``sdk``: the Python SDK (``hotloop_client.AsyncClient``) -> Ray Serve's gRPC proxy -> replica,
- ``direct``: the Python SDK with ``direct=True`` -> the replica's own gRPC server
  (``server.direct_ingress``; the session's owner found by ``ListReplicas``), no proxy,
- ``grpc``: a stock ``grpc.aio`` client with the generated stubs -> the same proxy,
- ``http``: ``/v1/chat/completions`` with ``"stream": true`` (aiohttp, server-sent events) ->
  Ray Serve's HTTP proxy -> replica (which hands the turn to the session's owner replica),

and reports, per row: delivered tokens/s against offered (N / step), CPU seconds per 1,000
tokens by process (Ray's proxy; the replica split into the engine's scheduler thread, the
thread running the servicer's event loop and the rest; Ray's other processes; the client),
inter-chunk gaps (p50/p99) against the step, tokens per chunk, and time to first token
against the engine's own (``Timings.time_to_first_token_ms`` of the final chunk).

Each step time gets its own server (``hotloop-serve run``, subprocess, stopped at the end).
Sessions are created before the clock starts; all N streams start together; every stream's
chunk arrival times are recorded. CPU is read from ``/proc`` before and after each row;
other jobs' CPU on the machine (neither the server tree nor this process) is reported too.

Run: ``.venv/bin/python bench/serving.py [--steps 10,15,30] [--streams 64,128,256]
[--clients engine,sdk,direct,grpc,http] [--tokens 200] [--coalesce-ms 0] [--messages-per-s 0] [--ray-env K=V ...]
[--tag NAME]``; writes ``bench/results/serving[_TAG].{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, HotloopServer, machine_facts, percentile, process_tree

MODEL = "gemma-3-270m"
TICK = os.sysconf("SC_CLK_TCK")
PROMPT = "Write a long story about a lighthouse keeper."


# ----------------------------------------------------------------------------- CPU accounting


def _thread_times(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of ``pid`` (threads of one name summed), from ``/proc``."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                # fields[0] is the state (3rd field of stat): utime/stime are the 14th/15th
                out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def _role(cmdline: str) -> str:
    if "ProxyActor" in cmdline:
        return "proxy"
    if "ServeReplica" in cmdline:
        return "replica"
    return "ray other"


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


@dataclass
class CpuSnapshot:
    """CPU seconds so far: per (role, thread group), this process, the whole machine."""

    by_part: dict[str, float]
    client: float
    machine: float
    threads: dict[str, float] = field(default_factory=dict)


def _replica_part(thread: str, loop_names: Sequence[str]) -> str:
    if thread.startswith("hotloop-schedu"):
        return "replica: engine scheduler"
    if any(thread.startswith(n) for n in loop_names):
        return "replica: event loop"
    return "replica: other threads"


REPLICA_LOOP_THREADS = ("replica_user_co", "asyncio", "ServeReplica")
"""Thread names (``comm``, 15 chars) of the replica thread(s) that run the servicer's event loop:
Ray 2.60 runs user code on its own loop in a thread named after it (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD``),
or, with that off, on the worker's main thread (named after the actor)."""


def cpu_snapshot(server_pid: int | None) -> CpuSnapshot:
    parts: dict[str, float] = {}
    threads: dict[str, float] = {}
    if server_pid is not None:
        for p in process_tree(server_pid):
            with contextlib.suppress(psutil.Error):
                role = _role(" ".join(p.cmdline()))
                if role == "replica":
                    for name, s in _thread_times(p.pid).items():
                        part = _replica_part(name, REPLICA_LOOP_THREADS)
                        parts[part] = parts.get(part, 0.0) + s
                        threads[f"replica/{name}"] = threads.get(f"replica/{name}", 0.0) + s
                else:
                    t = p.cpu_times()
                    parts[role] = parts.get(role, 0.0) + t.user + t.system
                    if role == "proxy":
                        for name, s in _thread_times(p.pid).items():
                            threads[f"proxy/{name}"] = threads.get(f"proxy/{name}", 0.0) + s
    me = psutil.Process().cpu_times()
    return CpuSnapshot(parts, me.user + me.system, _machine_busy_s(), threads)


# ----------------------------------------------------------------------------- one row


@dataclass
class StreamRecord:
    """One stream: when it was sent, its chunk arrival times, tokens, the engine's TTFT."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    engine_ttft_s: float | None = None
    error: str | None = None
    done: bool = False


Player = Callable[[StreamRecord], Awaitable[None]]
"""Plays one prepared stream into its record."""
Opener = Callable[[int], Awaitable[Player]]
"""Prepares stream ``i`` (its session) and returns its player."""


async def _run(player: Player, rec: StreamRecord) -> None:
    rec.sent = time.perf_counter()
    try:
        await player(rec)
    except Exception as e:  # recorded: a row with failed streams says so
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.done = True


async def play(players: Sequence[Player], records: Sequence[StreamRecord]) -> None:
    """Start every prepared stream at once, each into its record."""
    await asyncio.gather(*(_run(p, r) for p, r in zip(players, records, strict=True)))


PROBES = 20
"""Probe turns per row (see :func:`probe_under_load`)."""
PROBE_TOKENS = 2
"""A probe's reply: its final chunk (which carries the engine's own TTFT) comes a step after its first."""


async def probe_under_load(probes: Sequence[Player], load: Sequence[StreamRecord]) -> list[StreamRecord]:
    """One turn at a time into a stack already carrying ``load``: the TTFT overhead one user sees.

    The row's own TTFT overhead is that of N streams opened in the same millisecond, which on
    2 cores mostly measures how long the stack takes to accept a burst. What a user opening a
    conversation on a busy replica waits for beyond the engine is this: a turn sent alone while
    the N streams are in steady state (every one has its first token), its client-side TTFT
    minus the engine's (``Timings.time_to_first_token_ms``, from the turn reaching the engine's
    queue to its first token). Probes stop when the first of the N streams ends.
    """
    deadline = time.perf_counter() + 5.0
    while time.perf_counter() < deadline and not all(r.arrivals or r.done for r in load):
        await asyncio.sleep(0.005)
    records = []
    for player in probes:
        if any(r.done for r in load):
            break
        rec = StreamRecord(0.0)
        await _run(player, rec)
        records.append(rec)
        await asyncio.sleep(0.02)
    return records


def _overheads_ms(records: Sequence[StreamRecord]) -> list[float]:
    """Client-side TTFT minus the engine's, of every stream that has both."""
    return [
        (r.arrivals[0] - r.sent - r.engine_ttft_s) * 1e3
        for r in records
        if r.error is None and r.arrivals and r.engine_ttft_s is not None
    ]


def summarize_row(
    records: list[StreamRecord],
    step_s: float,
    before: CpuSnapshot,
    after: CpuSnapshot,
    wall_s: float,
    probes: Sequence[StreamRecord] = (),
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.arrivals]
    tokens = sum(r.tokens for r in ok)
    first = min((r.arrivals[0] for r in ok), default=0.0)
    last = max((r.arrivals[-1] for r in ok), default=0.0)
    # Decode rate, as bench/stack.py: every stream's tokens after its first, first to last chunk.
    delivered = sum(max(0, r.tokens - 1) for r in ok) / max(last - first, 1e-9)
    offered = len(records) / step_s
    gaps = [b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    chunks = sum(len(r.arrivals) for r in ok)
    ttft = [r.arrivals[0] - r.sent for r in ok]
    overhead = [ms / 1e3 for ms in _overheads_ms(ok)]
    probed = _overheads_ms(probes)
    k = 1000 / max(tokens, 1)
    cpu = {part: (after.by_part.get(part, 0.0) - s) * k for part, s in before.by_part.items()}
    for part, s in after.by_part.items():
        cpu.setdefault(part, s * k)  # a process born during the row
    cpu["client"] = (after.client - before.client) * k
    serving = sum(v for p, v in cpu.items() if p == "proxy" or (p.startswith("replica") and "scheduler" not in p))
    server_total = sum(after.by_part.values()) - sum(before.by_part.values())
    other = (after.machine - before.machine) - server_total - (after.client - before.client)
    threads = {
        name: round((s - before.threads.get(name, 0.0)) * k, 4)
        for name, s in after.threads.items()
        if (s - before.threads.get(name, 0.0)) * k >= 0.005
    }
    return {
        "streams": len(records),
        "errors": len(records) - len(ok),
        "error_sample": next((r.error for r in records if r.error), None),
        "tokens": tokens,
        "offered_tok_s": offered,
        "delivered_tok_s": delivered,
        "delivered_share": delivered / offered,
        "gap_p50_ms": (percentile(gaps, 50) or 0.0) * 1e3,
        "gap_p99_ms": (percentile(gaps, 99) or 0.0) * 1e3,
        "gap_p99_steps": (percentile(gaps, 99) or 0.0) / step_s,
        "tokens_per_chunk": tokens / max(chunks, 1),
        "ttft_p50_ms": (percentile(ttft, 50) or 0.0) * 1e3,
        "ttft_overhead_p50_ms": (percentile(overhead, 50) * 1e3) if overhead else None,
        "ttft_overhead_p99_ms": (percentile(overhead, 99) * 1e3) if overhead else None,
        "probes": len(probed),
        "probe_errors": sum(1 for r in probes if r.error is not None),
        "probe_overhead_p50_ms": percentile(probed, 50) if probed else None,
        "probe_overhead_p99_ms": percentile(probed, 99) if probed else None,
        "cpu_ms_per_token": {p: round(v, 4) for p, v in sorted(cpu.items())},
        "serving_cpu_ms_per_token": serving,
        "threads_ms_per_token": threads,
        "other_jobs_cores": max(0.0, other) / wall_s,
        "wall_s": wall_s,
    }


async def measure(
    n: int, opener: Opener, step_s: float, server_pid: int | None, probe_opener: Opener | None = None
) -> dict[str, Any]:
    """One row: ``n`` streams prepared (sessions created), then played at once, CPU read around
    it; with ``probe_opener``, :data:`PROBES` probe turns sent one by one while they run."""
    players = [await opener(i) for i in range(n)]
    probes = [await probe_opener(n + j) for j in range(PROBES)] if probe_opener else []
    records = [StreamRecord(0.0) for _ in players]
    before = cpu_snapshot(server_pid)
    t0 = time.perf_counter()
    load = asyncio.create_task(play(players, records))
    probed = await probe_under_load(probes, records) if probes else []
    await load
    wall = time.perf_counter() - t0
    after = cpu_snapshot(server_pid)
    return summarize_row(records, step_s, before, after, wall, probed)


# ----------------------------------------------------------------------------- the clients


def engine_opener(engine: Any, tokens: int, tag: str) -> Opener:
    from hotloop_serve.engine import SamplingSettings
    from hotloop_serve.engine.chat_template import ChatMessage

    settings = SamplingSettings(temperature=0, sample_len=tokens)

    async def open_one(i: int) -> Player:
        async def run(rec: StreamRecord) -> None:
            msgs = [ChatMessage("user", f"{PROMPT} ({tag} {i})")]
            stream = engine.generate(f"{tag}-{i}", "bench", msgs, settings)
            async for chunk in stream.chunks():
                rec.arrivals.append(time.perf_counter())
                if chunk.final:
                    rec.tokens = chunk.usage.completion_tokens
                    rec.engine_ttft_s = chunk.timings.time_to_first_token_ms / 1e3

        return run

    return open_one


def sdk_opener(client: Any, tokens: int, tag: str) -> Opener:
    from hotloop_client import Settings

    model = client.model(MODEL)

    async def open_one(i: int) -> Player:
        session = await model.new_session(settings=Settings(temperature=0, sample_len=tokens))

        async def run(rec: StreamRecord) -> None:
            async for chunk in session.generate([("user", f"{PROMPT} ({tag} {i})")]):
                rec.arrivals.append(time.perf_counter())
                if chunk.usage is not None:
                    rec.tokens = chunk.usage.completion_tokens
                if chunk.timings is not None:
                    rec.engine_ttft_s = chunk.timings.time_to_first_token_ms / 1e3

        return run

    return open_one


def grpc_opener(channel: Any, tokens: int, tag: str) -> Opener:
    """Plain generated stubs: what any language's stock gRPC client does (no SDK retry layer)."""
    import secrets

    from hotloop.v1 import common_pb2, session_pb2, session_pb2_grpc

    stub = session_pb2_grpc.SessionServiceStub(channel)

    async def open_one(i: int) -> Player:
        key = secrets.token_hex(8)
        md = (("application", MODEL), ("session_id", key))
        created = await stub.CreateSession(session_pb2.CreateSessionRequest(model=MODEL, session_key=key), metadata=md)
        request = session_pb2.GenerateRequest(
            session_id=created.id,
            messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content=f"{PROMPT} ({tag} {i})")],
            settings=common_pb2.Settings(temperature=0, sample_len=tokens),
        )

        async def run(rec: StreamRecord) -> None:
            async for pb in stub.Generate(request, metadata=md):
                rec.arrivals.append(time.perf_counter())
                if pb.finish_reason:
                    rec.tokens = pb.usage.completion_tokens
                    rec.engine_ttft_s = pb.timings.time_to_first_token_ms / 1e3

        return run

    return open_one


def http_opener(session: Any, base: str, tokens: int, tag: str) -> Opener:
    async def open_one(i: int) -> Player:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{PROMPT} ({tag} {i})"}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"x-session-id": f"{tag}-{i}"}

        async def run(rec: StreamRecord) -> None:
            async with session.post(f"{base}/{MODEL}/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "hotloop" in event:  # the server's own timings, on the reply's last object
                        rec.engine_ttft_s = event["hotloop"]["timings"]["time_to_first_token_ms"] / 1e3
                    if event.get("usage"):
                        rec.tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0]["delta"].get("content"):
                        rec.arrivals.append(time.perf_counter())

        return run

    return open_one


# ----------------------------------------------------------------------------- drivers


def engine_config(step_ms: float, width: int, tokens: int) -> dict[str, Any]:
    """Engine options for ``width`` streams of ``tokens``: every stream runs at once, and a probe
    turn beside them (:func:`probe_under_load`)."""
    return {
        "kind": "synthetic",
        "synthetic_step_ms": step_ms,
        "hot_sessions": width + 1,
        "max_sessions": 8192,  # every row opens new sessions; they stay until idle_ttl_s
        "context_tokens": width * 1024,
        "session_context_tokens": 1024,
        "batch_tokens": max(512, width + 1),
        "max_queue": 2 * width,
    }


def run_engine_rows(step_ms: float, streams: Sequence[int], tokens: int) -> list[dict[str, Any]]:
    from hotloop_serve.config import EMBEDDED_MODEL
    from hotloop_serve.engine import EngineOptions
    from hotloop_serve.engine.synthetic import open_engine
    from hotloop_serve.serve.model_source import resolve_model_path

    rows = []
    opts = EngineOptions(**engine_config(step_ms, max(streams), tokens))
    with open_engine(str(resolve_model_path(EMBEDDED_MODEL)), opts) as engine:
        asyncio.run(measure(4, engine_opener(engine, 8, "warm"), step_ms / 1e3, None))
        for n in streams:
            probe = engine_opener(engine, PROBE_TOKENS, f"p{n}")
            row = asyncio.run(measure(n, engine_opener(engine, tokens, f"e{n}"), step_ms / 1e3, None, probe))
            rows.append({"client": "engine", "step_ms": step_ms, **row})
            print_row(rows[-1])
    return rows


async def _stack_rows(
    server: HotloopServer,
    step_ms: float,
    streams: Sequence[int],
    tokens: int,
    clients: Sequence[str],
    on_row: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    import aiohttp
    import grpc
    from hotloop_client import AsyncClient

    rows: list[dict[str, Any]] = []
    pid = server.pid
    step_s = step_ms / 1e3
    sdk = AsyncClient(server.address, timeout=600)
    direct = AsyncClient(server.address, timeout=600, direct=True)
    channel = grpc.aio.insecure_channel(server.address)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    base = f"http://127.0.0.1:{server.http_port}"
    try:
        openers: dict[str, Callable[[int, str], Opener]] = {
            "sdk": lambda t, tag: sdk_opener(sdk, t, tag),
            "direct": lambda t, tag: sdk_opener(direct, t, tag),
            "grpc": lambda t, tag: grpc_opener(channel, t, tag),
            "http": lambda t, tag: http_opener(http, base, t, tag),
        }
        for name in clients:
            await measure(4, openers[name](8, f"warm-{name}"), step_s, pid)
            for n in streams:
                tag = f"{name}{n}-{time.time_ns()}"
                probe = openers[name](PROBE_TOKENS, f"probe-{tag}")
                row = await measure(n, openers[name](tokens, tag), step_s, pid, probe)
                rows.append({"client": name, "step_ms": step_ms, **row})
                print_row(rows[-1])
                on_row(rows[-1])
    finally:
        await http.close()
        await channel.close()
        await sdk.close()
        await direct.close()
    return rows


def run_stack_rows(
    step_ms: float,
    streams: Sequence[int],
    tokens: int,
    clients: Sequence[str],
    coalesce_ms: float,
    messages_per_s: float,
    ray_env: dict[str, str],
    log: Path,
    on_row: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    server = HotloopServer("serving", 1, 1, engine_config(step_ms, max(streams), tokens))
    server.config["server"]["stream_coalesce_ms"] = coalesce_ms
    if "direct" in clients:
        server.config["server"]["direct_ingress"] = True
    if messages_per_s:  # only when set: the bench also drives older trees (before/after runs)
        server.config["server"]["stream_messages_per_s"] = messages_per_s
    server.config["models"][0]["engine"].pop("threads", None)
    server.config["models"][0]["limits"] = {"sessions_per_principal": 4096}
    # An HTTP stream holds two of the replica's request slots (the ingress call, and its turn
    # handed to the session's owner through the deployment handle, here the same replica): at
    # the default (hot_sessions) more than hot_sessions / 2 HTTP streams stall waiting for slots.
    server.config["models"][0]["routing"] = {"max_ongoing_requests": 2 * max(streams) + 8}
    saved = {k: os.environ.get(k) for k in ray_env}
    os.environ.update(ray_env)  # inherited by the server and Ray's processes
    try:
        server.start(log)
        return asyncio.run(_stack_rows(server, step_ms, streams, tokens, clients, on_row))
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- report

HEADER = (
    "| client | step ms | streams | offered tok/s | delivered tok/s | delivered | gap p50 ms | gap p99 ms "
    "| p99/step | tok/chunk | TTFT p50 ms | TTFT overhead p50 ms | probe overhead p50 / p99 ms "
    "| serving CPU ms/tok | proxy | replica loop "
    "| replica other | engine sched | client | errors | other jobs' cores |"
)


def _f(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def print_row(r: dict[str, Any]) -> None:
    print(md_row(r), flush=True)


def md_row(r: dict[str, Any]) -> str:
    c = r["cpu_ms_per_token"]
    return (
        f"| {r['client']} | {r['step_ms']:g} | {r['streams']} | {r['offered_tok_s']:.0f} | {r['delivered_tok_s']:.0f} "
        f"| {r['delivered_share']:.0%} | {r['gap_p50_ms']:.1f} | {r['gap_p99_ms']:.1f} | {r['gap_p99_steps']:.1f} "
        f"| {r['tokens_per_chunk']:.2f} | {r['ttft_p50_ms']:.1f} | {_f(r['ttft_overhead_p50_ms'], 1)} "
        f"| {_f(r.get('probe_overhead_p50_ms'), 1)} / {_f(r.get('probe_overhead_p99_ms'), 1)} "
        f"| {r['serving_cpu_ms_per_token']:.3f} | {_f(c.get('proxy'), 3)} | {_f(c.get('replica: event loop'), 3)} "
        f"| {_f(c.get('replica: other threads'), 3)} | {_f(c.get('replica: engine scheduler'), 3)} "
        f"| {_f(c.get('client'), 3)} | {r['errors']} | {r['other_jobs_cores']:.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="10,15,30", help="step times in ms")
    ap.add_argument("--streams", default="64,128,256", help="concurrent streams")
    ap.add_argument("--clients", default="engine,sdk,direct,grpc,http")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--coalesce-ms", type=float, default=0.0, help="server.stream_coalesce_ms")
    ap.add_argument("--messages-per-s", type=float, default=0.0, help="server.stream_messages_per_s")
    ap.add_argument("--ray-env", action="append", default=[], help="K=V for the server's Ray processes")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ns = ap.parse_args()
    steps = [float(s) for s in ns.steps.split(",")]
    streams = [int(s) for s in ns.streams.split(",")]
    clients = ns.clients.split(",")
    ray_env = dict(kv.split("=", 1) for kv in ns.ray_env)
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"_{ns.tag}" if ns.tag else ""
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    rows: list[dict[str, Any]] = []
    facts = machine_facts()

    def write() -> None:  # after every server too: a run cut short keeps what it measured
        result = {"machine": facts, "args": vars(ns), "rows": rows}
        (RESULTS / f"serving{suffix}.json").write_text(json.dumps(result, indent=1))
        lines = [
            f"`bench/serving.py {' '.join(sys.argv[1:])}`, {facts['date']}, {facts['cores']} cores ({facts['cpu']}).",
            "",
            "CPU columns: ms of CPU per delivered token (serving = proxy + replica loop + replica other).",
            "",
            HEADER,
            "|" + "---|" * (HEADER.count("|") - 1),
            *(md_row(r) for r in rows),
        ]
        (RESULTS / f"serving{suffix}.md").write_text("\n".join(lines) + "\n")

    for step in steps:
        if "engine" in clients:
            rows.extend(run_engine_rows(step, streams, ns.tokens))
            write()
        stack = [c for c in clients if c != "engine"]
        if stack:
            log = RESULTS / f"serving{suffix}-server-{step:g}.log"

            def on_row(row: dict[str, Any]) -> None:
                rows.append(row)
                write()

            run_stack_rows(step, streams, ns.tokens, stack, ns.coalesce_ms, ns.messages_per_s, ray_env, log, on_row)
            log.unlink(missing_ok=True)
    write()


if __name__ == "__main__":
    main()
