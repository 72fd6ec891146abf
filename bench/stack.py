#!/usr/bin/env python3
"""The whole stack, layer by layer, in one run: where the engine's tokens/s go on their way out.

Rows, each at 1 and 8 concurrent sessions, identical settings (greedy, no repeat penalty,
fixed 64-token replies, prompts prefilled first so every row measures decoding):

1. the primitive: llama.cpp's low-level batched loop (its own process; ``bench/engine.py``)
2. the engine in-process (``Engine``)
3. the servicer in-process (``ModelServicer.Generate``, asyncio, no Ray, no gRPC)
4. the full stack: Python SDK (asyncio) -> Ray Serve's gRPC proxy -> replica -> engine, and
   the same through the TypeScript client (``bench/stack_ts.cjs``, Node.js)
5. through the full stack, one session's gaps between chunks, p50 and p99: decoding alone,
   then while three new sessions arrive with ~1,500-token prompts (ratio: to alone)

with the ratio of each to the engine. Row 2b attributes the full stack's loss: the engine
in-process again, while a Ray Serve deployment of the same model idles beside it (Ray's
daemons and Serve's loops wake up on the same cores). The full stack runs with our Ray
settings (``runner.RAY_SERVE_ENV``: slower Serve control loops, Ray workers at nice 0, proxies
reaching replicas over gRPC) and once more with Ray's stock ones (their same-run baseline),
each with the CPU time every process spent per generated token (client, Ray's proxy actor,
the replica, the rest of Ray), from psutil; the replica's is also split into llama.cpp's
compute threads and its other threads (event loops, Ray's core worker, gRPC). Decode tokens/s
are counted from each stream's first to its last chunk; the
engine and full-stack rows are the median of ``--repeats`` runs.

Run: ``.venv/bin/python bench/stack.py [--tokens 64] [--json bench/results/stack.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))

from engine import FIXED_PROMPT, fixed_run, primitive_isolated
from harness import percentile

from hotloop_serve.engine import Engine, EngineOptions, SamplingSettings
from hotloop_serve.serve.model_source import embedded_model_path

WIDTHS = (1, 8)
RAY_STOCK_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100",
    "RAY_worker_niceness": "15",
    "RAY_SERVE_PROXY_USE_GRPC": "0",
}
"""Ray Serve 2.60's defaults for what ``hotloop_serve.serve.runner.RAY_SERVE_ENV`` sets."""
TS_DIR = Path(__file__).resolve().parent.parent / "clients" / "typescript"
ROWS: list[dict[str, Any]] = []


def row(name: str, value: float, unit: str, base: float | None = None) -> None:
    ratio = f"{value / base:.2f}x" if base else ""
    print(f"| {name:<58} | {value:>9.2f} {unit:<6} | {ratio:>7} |")
    ROWS.append({"name": name, "value": value, "unit": unit, "ratio": value / base if base else None})


def decode_rate(streams: list[tuple[float, float, int]]) -> float:
    """Aggregate tokens/s from (first chunk time, last chunk time, tokens) per stream."""
    first = min(s[0] for s in streams)
    last = max(s[1] for s in streams)
    return sum(max(0, n - 1) for _, _, n in streams) / max(last - first, 1e-9)


def engine_rates(path: Path, tokens: int, threads: int, repeats: int, tag: str) -> dict[int, float]:
    """The in-process engine's decode rate at each width, the median of ``repeats`` runs."""
    greedy = SamplingSettings(temperature=0, sample_len=tokens, repeat_penalty=1.0)
    rates: dict[int, float] = {}
    with Engine(str(path), EngineOptions(threads=threads, context_tokens=16384)) as e:
        for n in WIDTHS:
            runs = sorted(fixed_run(e, n, tokens, greedy, f"{tag}{r}-")[0] for r in range(repeats))
            rates[n] = runs[len(runs) // 2]
    return rates


def servicer_rate(path: Path, n: int, tokens: int, threads: int) -> float:
    from hotloop.v1 import common_pb2, session_pb2

    from hotloop_serve.config import Config
    from hotloop_serve.serve.auth import Authenticator
    from hotloop_serve.serve.servicer import ModelServicer
    from hotloop_serve.serve.session_ids import SessionIds
    from hotloop_serve.telemetry import Telemetry

    config = Config()
    with Engine(str(path), EngineOptions(threads=threads, context_tokens=16384)) as e:
        svc = ModelServicer(
            config, config.models[0], e, SessionIds(b"k", "m"), Authenticator({}), Telemetry("m", "r", e.stats)
        )

        async def warm(i: int) -> session_pb2.GenerateRequest:
            sess = await svc.CreateSession(
                session_pb2.CreateSessionRequest(session_key=f"bench-{i:04d}-{time.time_ns()}")
            )
            msgs = [common_pb2.Message(role=common_pb2.ROLE_USER, content=f"{FIXED_PROMPT} (list {i})")]
            await svc.Warmup(session_pb2.WarmupRequest(session_id=sess.id, messages=msgs))
            return session_pb2.GenerateRequest(
                session_id=sess.id,
                messages=msgs,
                settings={"temperature": 0, "sample_len": tokens, "repeat_penalty": 1.0},
            )

        async def one(req: session_pb2.GenerateRequest) -> tuple[float, float, int]:
            first = last = 0.0
            count = 0
            async for chunk in svc.Generate(req):
                last = time.perf_counter()
                first = first or last
                count = chunk.usage.completion_tokens or count
            return first, last, count

        async def all_of() -> list[tuple[float, float, int]]:
            # Every prompt prefilled first, as in the other rows: only decoding is timed.
            requests = [await warm(i) for i in range(n)]
            return list(await asyncio.gather(*(one(r) for r in requests)))

        return decode_rate(asyncio.run(all_of()))


def ray_processes() -> dict[str, list[psutil.Process]]:
    groups: dict[str, list[psutil.Process]] = {"proxy": [], "replica": [], "ray (other)": []}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ProxyActor" in cmd:
            groups["proxy"].append(p)
        elif "ServeReplica" in cmd:
            groups["replica"].append(p)
        elif "ray" in cmd and p.pid != os.getpid() and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd):
            groups["ray (other)"].append(p)
    return groups


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def thread_cpu_seconds(procs: list[psutil.Process]) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of ``procs``, by (pid, thread id)."""
    out: dict[tuple[int, int], float] = {}
    for p in procs:
        try:
            for t in p.threads():
                out[p.pid, t.id] = t.user_time + t.system_time
        except psutil.Error:
            continue
    return out


class CpuMeter:
    """CPU time of Ray's processes from now on, per generated token (with the client's, given).

    The replica's is also split by thread: its ``compute_threads`` busiest threads are
    llama.cpp's (the engine's scheduler thread and its OpenMP workers, busy the whole run), the
    rest are the replica's event loops, Ray's core worker and gRPC threads: the serving stack's
    own cost inside the replica.
    """

    def __init__(self, compute_threads: int) -> None:
        self.compute_threads = compute_threads
        self.groups = ray_processes()
        self.before = {k: cpu_seconds(v) for k, v in self.groups.items()}
        self.replica_threads = thread_cpu_seconds(self.groups["replica"])

    def per_token(self, streams: list[tuple[float, float, int]], client: str, client_s: float) -> dict[str, float]:
        generated = sum(c for _, _, c in streams)
        cpu = {k: (cpu_seconds(v) - self.before[k]) * 1e3 / generated for k, v in self.groups.items()}
        after = thread_cpu_seconds(self.groups["replica"])
        spent = sorted((s - self.replica_threads.get(t, 0.0) for t, s in after.items()), reverse=True)
        cpu[f"replica: llama.cpp's {self.compute_threads} threads"] = (
            sum(spent[: self.compute_threads]) * 1e3 / generated
        )
        cpu["replica: its other threads"] = sum(spent[self.compute_threads :]) * 1e3 / generated
        cpu[client] = client_s * 1e3 / generated
        return cpu


def ts_client() -> str | None:
    """Why the TypeScript row can't run (None: it can); builds the client's dist/ if needed."""
    import shutil
    import subprocess

    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node/npm not installed"
    if not (TS_DIR / "dist" / "src" / "index.js").exists():
        steps = ([] if (TS_DIR / "node_modules").exists() else [["npm", "ci"]]) + [["npm", "run", "build"]]
        for cmd in steps:
            done = subprocess.run(cmd, cwd=TS_DIR, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"{' '.join(cmd)} failed: {done.stderr[-300:]}"
    return None


def ts_run(address: str, n: int, tokens: int) -> tuple[list[tuple[float, float, int]], float]:
    """One decode measurement through the TypeScript client: (streams, client CPU seconds)."""
    import subprocess

    script = Path(__file__).resolve().parent / "stack_ts.cjs"
    done = subprocess.run(
        ["node", str(script), address, "stack", str(n), str(tokens), FIXED_PROMPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return [tuple(x) for x in out["streams"]], float(out["cpu_s"])


CLIENTS = ("Python SDK", "TypeScript client")


def median_run(runs: list[tuple[float, dict[str, float]]]) -> tuple[float, dict[str, float]]:
    """The run with the median rate (one run of 64 tokens at one session lasts under 2 s)."""
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


def stack_rates(
    tokens: int,
    threads: int,
    coalesce_ms: float = 0.0,
    gaps: dict[str, list[float]] | None = None,
    typescript: bool = False,
    repeats: int = 3,
    beside: dict[int, float] | None = None,
) -> dict[tuple[str, int], tuple[float, dict[str, float]]]:
    """Full-stack decode rate and CPU per token per (client, width); fills ``gaps`` if given,
    and ``beside`` with the in-process engine's rates while the deployment idles."""
    from hotloop_client import AsyncClient, Message, Role, Settings

    from hotloop_serve.config import config_from_dict
    from hotloop_serve.serve.probe import free_port, wait_until_serving
    from hotloop_serve.serve.runner import start_server, stop_server

    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    port = free_port()
    engine = {"context_tokens": 16384, "hot_sessions": 8, "threads": threads}
    config = config_from_dict(
        {
            "server": {"grpc_port": port, "http_port": free_port(), "stream_coalesce_ms": coalesce_ms},
            "telemetry": {"enabled": False},
            "models": [{"name": "stack", "engine": engine, "resources": {"num_cpus": 1}}],
        }
    )
    results: dict[tuple[str, int], tuple[float, dict[str, float]]] = {}
    start_server(config, num_cpus=4)
    try:
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, ["stack"], timeout_s=300)
        settings = Settings(temperature=0, sample_len=tokens, repeat_penalty=1.0)
        me = psutil.Process()

        async def run(n: int) -> tuple[float, dict[str, float]]:
            async with AsyncClient(address) as client:
                model = client.model("stack")
                sessions = [await model.new_session(settings=settings) for _ in range(n)]
                histories = [[Message(Role.USER, f"{FIXED_PROMPT} (list {i})")] for i in range(n)]
                for s, h in zip(sessions, histories, strict=True):
                    await s.warmup(h)
                meter = CpuMeter(threads)
                mine = me.cpu_times()

                async def one(i: int) -> tuple[float, float, int]:
                    first = last = 0.0
                    count = 0
                    async for chunk in sessions[i].generate(histories[i]):
                        last = time.perf_counter()
                        first = first or last
                        if chunk.usage is not None:
                            count = chunk.usage.completion_tokens
                    return first, last, count

                streams = list(await asyncio.gather(*(one(i) for i in range(n))))
                mine_after = me.cpu_times()
                client_s = mine_after.user + mine_after.system - mine.user - mine.system
                cpu = meter.per_token(streams, "client (this process)", client_s)
                for s in sessions:
                    await s.close()
                return decode_rate(streams), cpu

        if beside is not None:
            beside.update(engine_rates(embedded_model_path(), tokens, threads, repeats, "beside"))
        for n in WIDTHS:
            results[CLIENTS[0], n] = median_run([asyncio.run(run(n)) for _ in range(repeats)])
        for n in WIDTHS if typescript else ():

            def ts(n: int = n) -> tuple[float, dict[str, float]]:
                meter = CpuMeter(threads)
                streams, client_s = ts_run(address, n, tokens)
                return decode_rate(streams), meter.per_token(streams, "client (node)", client_s)

            results[CLIENTS[1], n] = median_run([ts() for _ in range(repeats)])
        if gaps is not None:
            gaps.update(asyncio.run(inter_token_gaps(address)))
    finally:
        stop_server()
    return results


async def inter_token_gaps(address: str, cold: int = 3, tokens: int = 96) -> dict[str, list[float]]:
    """One session's gaps between chunks (ms): decoding alone, then while ``cold`` other
    sessions arrive with ~1,500-token prompts to prefill (a chat's first turns)."""
    from hotloop_client import AsyncClient

    async with AsyncClient(address) as client:
        model = client.model("stack")
        return {
            "alone": await gaps_of_one(model, "alone", 0, tokens),
            f"while {cold} sessions prefill": await gaps_of_one(model, "busy", cold, tokens),
        }


async def gaps_of_one(model: Any, label: str, others: int, tokens: int) -> list[float]:
    from hotloop_client import Message, Role, Settings

    long_prompt = " ".join(f"{FIXED_PROMPT} ({i})" for i in range(60))  # 1,550 tokens
    s = await model.new_session(settings=Settings(temperature=0, sample_len=tokens, repeat_penalty=1.0))
    history = [Message(Role.USER, f"{FIXED_PROMPT} (gaps {label})")]
    await s.warmup(history)
    newcomers = [await model.new_session(settings=Settings(sample_len=1)) for _ in range(others)]
    arrivals: list[float] = []
    started = asyncio.Event()

    async def decode() -> None:
        async for _ in s.generate(history):
            arrivals.append(time.perf_counter())
            started.set()

    async def prefill(i: int) -> None:
        await started.wait()
        await asyncio.sleep(0.2 * i)  # staggered, as users arrive
        async for _ in newcomers[i].generate([Message(Role.USER, f"{long_prompt} [{label} {i}]")]):
            pass

    await asyncio.gather(decode(), *(prefill(i) for i in range(others)))
    for x in (s, *newcomers):
        await x.close()
    return [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--coalesce-ms", type=float, nargs="*", default=[0.0], help="server.stream_coalesce_ms values")
    ap.add_argument(
        "--ray-stock-intervals",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the full stack with Ray Serve's stock settings (the baseline of runner.RAY_SERVE_ENV)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="engine and full-stack rows: the median of this many runs")
    ap.add_argument(
        "--typescript",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the full stack through the TypeScript client (Node.js; builds it if needed)",
    )
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "stack.json")
    ns = ap.parse_args()
    path = embedded_model_path(progress=True)
    print(f"model {path.name}, {ns.threads} threads, {ns.tokens}-token replies\n")
    print(f"| {'layer':<58} | {'value':>16} | {'vs eng':>7} |")
    print(f"|{'-' * 60}|{'-' * 18}|{'-' * 9}|")
    engine = engine_rates(path, ns.tokens, ns.threads, ns.repeats, "stack")
    for n in WIDTHS:
        prim = primitive_isolated(ns.tokens, ns.threads, n)
        row(f"1. primitive batched loop, {n} seq", prim, "tok/s", engine[n])
        row(f"2. engine, {n} sessions (baseline)", engine[n], "tok/s")
        row(f"3. servicer in-process, {n} sessions", servicer_rate(path, n, ns.tokens, ns.threads), "tok/s", engine[n])
    ts_missing = ts_client() if ns.typescript else "--no-typescript"
    if ts_missing:
        print(f"(no TypeScript row: {ts_missing})")
    passes = [(c, "") for c in ns.coalesce_ms]
    if ns.ray_stock_intervals:
        passes.append((ns.coalesce_ms[0], "Ray's stock settings"))
    for coalesce, variant in passes:
        saved = {k: os.environ.get(k) for k in RAY_STOCK_ENV}
        if variant:
            os.environ.update(RAY_STOCK_ENV)
        gaps: dict[str, list[float]] | None = {} if not variant and coalesce == ns.coalesce_ms[0] else None
        try:
            first = not variant and coalesce == ns.coalesce_ms[0]
            beside: dict[int, float] | None = {} if first else None
            rates = stack_rates(ns.tokens, ns.threads, coalesce, gaps, first and not ts_missing, ns.repeats, beside)
            for n, rate in (beside or {}).items():
                row(f"2b. engine, {n} sessions, a Ray Serve deployment idle beside it", rate, "tok/s", engine[n])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for (client, n), (rate, cpu) in rates.items():
            label = variant or f"coalesce {coalesce:g} ms"
            label = label if client == CLIENTS[0] else f"{client}, {label}"
            row(f"4. full stack, {n} sessions, {label}", rate, "tok/s", engine[n])
            for who, ms in cpu.items():
                print(f"|   {'CPU ms per token: ' + who:<56} | {ms:>9.2f} ms     |         |")
                ROWS.append({"name": f"cpu {n} {label} {who}", "value": ms, "unit": "ms/token"})
        for label, values in (gaps or {}).items():
            alone = (gaps or {}).get("alone")
            for q in (50, 99):
                base = percentile(alone, q) if alone and label != "alone" else None
                row(f"5. inter-token gap p{q}, {label}", percentile(values, q) or 0.0, "ms", base)
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"threads": ns.threads, "tokens": ns.tokens, "rows": ROWS}, indent=2))
    print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
