#!/usr/bin/env python3
"""Chaos soak: sustained load and real faults at once, every reply checked byte for byte.

Many conversations (more than ``hot_sessions``, so caches are evicted, restored and
pre-empted) run greedy, turn after turn, through the Python SDK and the OpenAI HTTP API
(the ``openai`` package) at once, while a fault schedule runs on the live server
(``chaos_server.py``): SIGKILL of a replica's process, ``hotloop-serve apply`` scaling 2 -> 3
-> 2 and rolling the replicas, the KV pool driven full by long first turns, and a whole-server
stop and start with ``persist_dir``. Users misbehave too (``chaos_clients.py``): streams
cancelled after their first chunk and resent, slow readers, HTTP connections dropped
mid-stream, sessions forked or moved by export and import between turns.

Afterwards every history that got a reply is computed again alone, one session at a time on a
freshly started engine in this process with the server's engine options (nothing else
running), and the reply must be the same bytes. The invariants (docs/reliability.md):

1. no lost turn: each turn completes, or fails with a documented retryable status and its retry
   completes;
2. byte-exact: every reply equals its reference (the server runs ``engine.deterministic``);
3. bounded resources: replica RSS, open descriptors, sessions tracked and disk tier bytes end
   within their bounds;
4. errors are only the documented statuses, and no attempt hangs past its deadline.

It prints a results table, writes ``--json`` (and ``--md``), and exits 1 if an invariant
failed. ``--short`` is the ~3 minute variant ``tests/integration/test_chaos.py`` runs in
``make test``; the default is the 10 minute soak.

Run: ``.venv/bin/python bench/chaos.py [--short] [--minutes 10] [--json PATH] [--md PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_clients import HttpWorker, LoadContext, ResponsesWorker, SdkWorker, TurnLog
from chaos_server import MODEL, ChaosServer

MiB = 1024**2
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class SoakSpec:
    minutes: float
    sdk_conversations: int
    http_conversations: int
    responses_conversations: int
    turns: int
    reply_tokens: int
    user_words: tuple[int, int]
    faults: tuple[str, ...]
    """Run in this order, one after another, spaced evenly over the soak."""
    hot_sessions: int = 3
    session_context_tokens: int = 1024
    fill_sessions: int = 4
    evicted_bytes: int = 96 * MiB
    persist_bytes: int = 512 * MiB
    sessions_per_principal: int = 256
    seed: int = 1


SHORT = SoakSpec(
    minutes=1.5,
    sdk_conversations=4,
    http_conversations=2,
    responses_conversations=1,
    turns=4,
    reply_tokens=16,
    user_words=(8, 24),
    faults=("kill", "kv_full", "restart"),
    hot_sessions=2,
    fill_sessions=3,
)
FULL = SoakSpec(
    minutes=10,
    sdk_conversations=8,
    http_conversations=3,
    responses_conversations=2,
    turns=6,
    reply_tokens=24,
    user_words=(10, 40),
    faults=("kill", "scale_out", "kv_full", "scale_in", "roll", "restart", "kill", "kv_full"),
)


@dataclass
class FaultWindow:
    kind: str
    start_s: float
    end_s: float
    detail: str = ""
    error: str = ""


@dataclass
class ResourceTrack:
    """Samples every few seconds: replica RSS and descriptors, sessions tracked, disk tier."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    baseline_rss: int = 0
    baseline_fds: int = 0

    def peak(self, key: str) -> int:
        return max((int(s[key]) for s in self.samples), default=0)


# ---------------------------------------------------------------------------------------
# The soak
# ---------------------------------------------------------------------------------------


def engine_options(spec: SoakSpec, persist_dir: Path) -> dict[str, Any]:
    return {
        "deterministic": True,
        "kv_layout": "per_session",
        "hot_sessions": spec.hot_sessions,
        "context_tokens": spec.hot_sessions * spec.session_context_tokens,
        "session_context_tokens": spec.session_context_tokens,
        "evicted_bytes": spec.evicted_bytes,
        "persist_dir": str(persist_dir),
        "persist_bytes": spec.persist_bytes,
        "threads": 1,
    }


def sessions_tracked(address: str) -> int | None:
    from hotloop_client import Client

    try:
        with Client(address, timeout=10) as c:
            return len(c.model(MODEL).list_sessions())
    except Exception:
        return None


def sample(server: ChaosServer, track: ResourceTrack, ctx: LoadContext, with_sessions: bool) -> None:
    reps = server.sample_replicas()
    track.samples.append(
        {
            "t": round(ctx.now(), 1),
            "replicas": len(reps),
            "rss_total": sum(r.rss for r in reps),
            "rss_max": max((r.rss for r in reps), default=0),
            "fds_max": max((r.fds for r in reps), default=0),
            "disk_bytes": server.disk_bytes(),
            "sessions": sessions_tracked(server.address) if with_sessions else None,
        }
    )


def run_faults(spec: SoakSpec, server: ChaosServer, ctx: LoadContext, client: Any, windows: list[FaultWindow]) -> None:
    """The fault schedule: each fault in turn, evenly spaced, each waited out before the next."""
    rng = random.Random(spec.seed)
    gap = spec.minutes * 60 / (len(spec.faults) + 1)
    for i, kind in enumerate(spec.faults):
        if ctx.stop.wait(max(0.0, (i + 1) * gap - ctx.now())):
            return
        w = FaultWindow(kind, ctx.now(), 0.0)
        try:
            w.detail = inflict(kind, spec, server, ctx, client, rng)
        except Exception as exc:
            w.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        w.end_s = ctx.now()
        windows.append(w)
        print(f"  [{w.start_s:6.1f}-{w.end_s:6.1f} s] {kind}: {w.detail or w.error}", flush=True)


def inflict(kind: str, spec: SoakSpec, server: ChaosServer, ctx: LoadContext, client: Any, rng: random.Random) -> str:
    if kind == "kill":
        detail = server.kill_replica(rng)
        wait_for_replicas(server, server.replicas, timeout_s=180)
        return detail
    if kind == "scale_out":
        return server.apply(replicas=server.replicas + 1)
    if kind == "scale_in":
        return server.apply(replicas=max(1, server.replicas - 1))
    if kind == "roll":
        # Any engine change rolls every replica (sessions handed over); pacing is one that must
        # not change a deterministic reply.
        step = 140.0 if server.engine.get("step_target_ms", 150.0) == 150.0 else 150.0
        return server.apply(step_target_ms=step)
    if kind == "kv_full":
        fillers = [
            SdkWorker(ctx, client, f"fill{i}", seed=rng.randrange(1 << 30), api="fill")
            for i in range(spec.fill_sessions)
        ]
        words = int(spec.session_context_tokens * 0.6)
        threads = [threading.Thread(target=f.conversation, args=(1, words), daemon=True) for f in fillers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=ctx.turn_budget_s + 30)
        return f"{spec.fill_sessions} first turns of ~{words} words at once"
    if kind == "restart":
        return server.restart()
    raise ValueError(f"unknown fault {kind!r}")


def wait_for_replicas(server: ChaosServer, n: int, timeout_s: float) -> None:
    """Until Ray has started the killed replica's replacement (a process for each of ``n``)."""
    from hotloop_serve.serve.probe import wait_until_serving

    time.sleep(2)
    deadline = time.monotonic() + timeout_s
    while len(server.replica_processes()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(server.replica_processes())} of {n} replicas after {timeout_s:.0f} s")
        time.sleep(1)
    wait_until_serving(server.address, [MODEL], timeout_s=timeout_s)


def soak(spec: SoakSpec, workdir: Path) -> dict[str, Any]:
    from hotloop_client import Client

    persist = workdir / "persist"
    server = ChaosServer(
        workdir,
        engine=engine_options(spec, persist),
        replicas=2,
        limits={"sessions_per_principal": spec.sessions_per_principal},
    )
    print(f"starting hotloop-serve (2 replicas, deterministic) in {workdir} ...", flush=True)
    started = server.start()
    print(f"  serving after {started:.1f} s", flush=True)
    ctx = LoadContext(
        address=server.address,
        http_base=server.http_base,
        model=MODEL,
        reply_tokens=spec.reply_tokens,
        turns=spec.turns,
        user_words=spec.user_words,
        turn_budget_s=300.0,
        attempt_timeout_s=180.0,
    )
    track = ResourceTrack()
    windows: list[FaultWindow] = []
    result: dict[str, Any] = {}
    client = Client(server.address, timeout=180)
    try:
        sample(server, track, ctx, with_sessions=True)
        track.baseline_rss = track.samples[-1]["rss_max"]
        track.baseline_fds = track.samples[-1]["fds_max"]
        rng = random.Random(spec.seed)
        workers: list[threading.Thread] = [
            SdkWorker(ctx, client, f"sdk{i}", seed=rng.randrange(1 << 30)) for i in range(spec.sdk_conversations)
        ]
        workers += [HttpWorker(ctx, f"http{i}", seed=rng.randrange(1 << 30)) for i in range(spec.http_conversations)]
        workers += [
            ResponsesWorker(ctx, f"resp{i}", seed=rng.randrange(1 << 30)) for i in range(spec.responses_conversations)
        ]
        ctx.t0 = time.monotonic()
        for w in workers:
            w.start()
        faults = threading.Thread(target=run_faults, args=(spec, server, ctx, client, windows), daemon=True)
        faults.start()
        end = ctx.t0 + spec.minutes * 60
        while time.monotonic() < end or faults.is_alive():
            time.sleep(3)
            sample(server, track, ctx, with_sessions=len(track.samples) % 4 == 0)
            if time.monotonic() > end + 900:
                break  # a fault that never finished: reported as such
        ctx.stop.set()
        load_end = ctx.now()
        for w in workers:
            w.join(timeout=ctx.turn_budget_s + 60)
        hung = [w.name for w in workers if w.is_alive()]
        faults.join(timeout=5)
        # After the load: every SDK session is closed; give evictions and disk writes a moment.
        time.sleep(5)
        sample(server, track, ctx, with_sessions=True)
        final = track.samples[-1]
        result = {
            "load_s": round(load_end, 1),
            "hung_workers": hung,
            "faults_unfinished": faults.is_alive(),
            "final": final,
        }
    finally:
        client.close()
        server.stop()
    result.update(
        {
            "spec": asdict(spec),
            "windows": [asdict(w) for w in windows],
            "ops": dict(ctx.ops),
            "logs": ctx.logs,
            "track": track,
        }
    )
    return result


# ---------------------------------------------------------------------------------------
# The reference: each history alone on a fresh engine
# ---------------------------------------------------------------------------------------


def references(spec: SoakSpec, logs: list[TurnLog], cold: bool = False) -> dict[tuple[tuple[str, str], ...], str]:
    """Each distinct answered history's reply computed alone: on one freshly started engine with
    the server's engine options (no disk tier), one session at a time, nothing else running.

    ``cold``: every history in a new session, prefilled from nothing (the strictest reference,
    and the slowest). Otherwise a conversation's turns run in order in one session, as a single
    user alone would have them: a history that continues the previous one (its previous turn's
    history plus that turn's reference reply) is a follow-up over that session's cache, anything
    else starts a new session. That decoded-versus-prefilled caches agree is what
    ``tests/unit/test_deterministic.py`` checks; here both sides of a divergence are computed.
    """
    from hotloop_serve.engine import ChatMessage, Engine, EngineOptions, SamplingSettings
    from hotloop_serve.serve.model_source import embedded_model_path

    options = EngineOptions(**{**engine_options(spec, Path("/nonexistent")), "persist_dir": ""})
    settings = SamplingSettings(temperature=0, sample_len=spec.reply_tokens, repeat_penalty=1.0, seed=7)
    # Sorted, a conversation's histories come one after another, each right after the one it
    # continues: one reference session is open at a time.
    histories = sorted({log.history for log in logs if log.reply is not None})
    out: dict[tuple[tuple[str, str], ...], str] = {}
    sid, tail = "", None
    with Engine(str(embedded_model_path(progress=False)), options) as engine:
        for i, h in enumerate(histories):
            if cold or h[:-1] != tail:
                if sid:
                    engine.close_session(sid, "ref")
                sid = f"ref{i}"
            out[h] = engine.generate(sid, "ref", [ChatMessage(r, c) for r, c in h], settings).result().text
            tail = (*h, ("assistant", out[h]))
            while engine.stats().active_requests:  # the reply's last token is cached a step later
                time.sleep(0.005)
    return out


# ---------------------------------------------------------------------------------------
# Checking and reporting
# ---------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def in_window(t: float, windows: list[FaultWindow], settle_s: float = 10.0) -> bool:
    return any(w.start_s <= t <= w.end_s + settle_s for w in windows)


def check(result: dict[str, Any], refs: dict[Any, str]) -> dict[str, Any]:
    spec: dict[str, Any] = result["spec"]
    logs: list[TurnLog] = result["logs"]
    windows = [FaultWindow(**w) for w in result["windows"]]
    track: ResourceTrack = result["track"]
    final = result.get("final", {})

    lost = [lg for lg in logs if lg.lost]
    mismatched = [lg for lg in logs if lg.reply is not None and refs.get(lg.history) != lg.reply]
    violations = Counter(lg.violation.split(":")[0] for lg in logs if lg.violation)
    retries = Counter(r.split(":")[0] for lg in logs for r in lg.retried)
    ttft_in = [lg.ttft_s for lg in logs if lg.ttft_s is not None and in_window(lg.t_start, windows)]
    ttft_out = [lg.ttft_s for lg in logs if lg.ttft_s is not None and not in_window(lg.t_start, windows)]

    rss_bound = track.baseline_rss + spec["evicted_bytes"] + 256 * MiB
    fds_bound = track.baseline_fds + 64
    bounds = {
        "replica_rss_final_max": (final.get("rss_max", 0), rss_bound),
        "replica_fds_final_max": (final.get("fds_max", 0), fds_bound),
        "disk_bytes_final": (final.get("disk_bytes", 0), spec["persist_bytes"]),
        "sessions_tracked_final": (final.get("sessions") or 0, spec["sessions_per_principal"]),
    }
    failed: list[str] = []
    if lost:
        failed.append(f"{len(lost)} lost turns")
    if mismatched:
        failed.append(f"{len(mismatched)} replies differ from their reference")
    if violations:
        failed.append(f"undocumented errors: {dict(violations)}")
    for name, (value, bound) in bounds.items():
        if value > bound:
            failed.append(f"{name} {value} over its bound {bound}")
    if final.get("sessions") is None:
        failed.append("sessions tracked could not be read after the load")
    if result.get("hung_workers"):
        failed.append(f"workers still in a turn after the load: {result['hung_workers']}")
    if result.get("faults_unfinished"):
        failed.append("a fault never finished")
    failed += [f"fault {w.kind} failed: {w.error}" for w in windows if w.error]

    examples = [
        {
            "conversation": lg.conversation,
            "api": lg.api,
            "turn": sum(1 for r, _ in lg.history if r == "user"),
            "via": lg.via,
            "retried": lg.retried,
            "got": lg.reply,
            "want": refs.get(lg.history),
        }
        for lg in mismatched[:5]
    ]
    return {
        "faults": dict(Counter(w.kind for w in windows)),
        "turns": len(logs),
        "turns_by_api": dict(Counter(lg.api for lg in logs)),
        "completed": len(logs) - len(lost),
        "lost": len(lost),
        "mismatched": len(mismatched),
        "retried_turns": sum(1 for lg in logs if lg.retried),
        "retries_by_cause": dict(retries),
        "violations": dict(violations),
        "violation_examples": [lg.violation for lg in logs if lg.violation][:5],
        "mismatch_examples": examples,
        "moved_by": dict(Counter(lg.via for lg in logs if lg.via)),
        "behaviours": dict(Counter(lg.behaviour for lg in logs if lg.behaviour)),
        "ops": result["ops"],
        "ttft_in_faults_p50_p99_s": [pct(ttft_in, 0.5), pct(ttft_in, 0.99)],
        "ttft_outside_p50_p99_s": [pct(ttft_out, 0.5), pct(ttft_out, 0.99)],
        "turns_in_faults": len(ttft_in),
        "rss_peak_mib": round(track.peak("rss_max") / MiB),
        "rss_final_mib": round(final.get("rss_max", 0) / MiB),
        "rss_baseline_mib": round(track.baseline_rss / MiB),
        "bounds": {k: [v, b] for k, (v, b) in bounds.items()},
        "sessions_tracked_peak": track.peak("sessions") if any(s["sessions"] for s in track.samples) else None,
        "disk_bytes_peak": track.peak("disk_bytes"),
        "load_s": result.get("load_s"),
        "windows": result["windows"],
        "failed": failed,
        "turn_log": [
            [round(lg.t_start, 1), lg.api, lg.conversation, lg.attempts, lg.retried, lg.violation[:160]]
            for lg in logs
            if lg.retried or lg.violation
        ],
    }


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(report: dict[str, Any]) -> str:
    t_in, t_out = report["ttft_in_faults_p50_p99_s"], report["ttft_outside_p50_p99_s"]
    rows = [
        ("faults injected", ", ".join(f"{k} x{v}" for k, v in report["faults"].items()) or "none"),
        ("turns (by API)", f"{report['turns']} ({', '.join(f'{k} {v}' for k, v in report['turns_by_api'].items())})"),
        ("lost", str(report["lost"])),
        ("mismatched (byte-exact vs alone)", str(report["mismatched"])),
        ("retried turns (causes)", f"{report['retried_turns']} ({report['retries_by_cause']})"),
        ("undocumented errors", str(report["violations"] or "none")),
        ("sessions moved (fork / import) then checked", str(report["moved_by"] or "none")),
        ("TTFT p50 / p99 in fault windows (+10 s)",
         f"{fmt_s(t_in[0])} / {fmt_s(t_in[1])} s ({report['turns_in_faults']} turns)"),
        ("TTFT p50 / p99 outside", f"{fmt_s(t_out[0])} / {fmt_s(t_out[1])} s"),
        ("replica RSS baseline / peak / final",
         f"{report['rss_baseline_mib']} / {report['rss_peak_mib']} / {report['rss_final_mib']} MiB"),
        ("bounds (final, bound)", ", ".join(f"{k} {v[0]} <= {v[1]}" for k, v in report["bounds"].items())),
        ("verdict", "PASS" if not report["failed"] else "FAIL: " + "; ".join(report["failed"])),
    ]  # fmt: skip
    lines = ["| | |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]
    lines += ["", "Fault windows:", ""]
    lines += [
        f"- {w['kind']} {w['start_s']:.0f}-{w['end_s']:.0f} s: {w['detail'] or w['error']}" for w in report["windows"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the ~3 minute variant make test runs")
    ap.add_argument("--minutes", type=float, help="length of the load (default: 10, short 1.5)")
    ap.add_argument("--faults", help="comma-separated fault schedule (kill,scale_out,scale_in,roll,kv_full,restart)")
    ap.add_argument("--json", type=Path, help="write the report here (default: bench/results/chaos[_short].json)")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (server logs, configs)")
    ap.add_argument(
        "--cold-references", action="store_true", help="compute every reference from nothing (slower, strictest)"
    )
    args = ap.parse_args(argv)
    spec = SHORT if args.short else FULL
    if args.minutes:
        spec.minutes = args.minutes
    if args.faults:
        spec.faults = tuple(f for f in args.faults.split(",") if f)
    name = "chaos_short" if args.short else "chaos"
    workdir = Path(tempfile.mkdtemp(prefix="hotloop-chaos-"))
    t0 = time.monotonic()
    result = soak(spec, workdir)
    print(f"load done after {time.monotonic() - t0:.0f} s; computing references ...", flush=True)
    t_ref = time.monotonic()
    refs = references(spec, result["logs"], cold=args.cold_references)
    report = check(result, refs)
    report["reference_s"] = round(time.monotonic() - t_ref, 1)
    report["references"] = "cold" if args.cold_references else "each conversation alone, in order"
    report["wall_s"] = round(time.monotonic() - t0, 1)
    table = markdown(report)
    print(table)
    out = args.json or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    (args.md or out.with_suffix(".md")).write_text(table + "\n")
    if not args.keep:
        import shutil

        with contextlib.suppress(OSError):
            shutil.rmtree(workdir)
    else:
        print(f"work directory kept: {workdir}")
    print(f"wall {report['wall_s']:.0f} s (references {report['reference_s']:.0f} s)")
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
