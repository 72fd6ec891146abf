#!/usr/bin/env python3
"""Engine benchmark: the figures of the engine issue, side by side, in one run.

1. raw ``llama_cpp.Llama`` single-stream decode tokens/s (the baseline)
2. engine single-stream decode tokens/s
3. engine aggregate tokens/s with 1, 2, 4, 8 concurrent sessions
4. follow-up time to first token with a ~1,500-token history: hot session vs cold
5. after an eviction: restore from host RAM vs recompute
6. KV bytes per hot session (and per token)
7. telemetry overhead: servicer single stream with OpenTelemetry SDK providers vs none

Run: ``.venv/bin/python bench/engine.py [--tokens 128] [--threads 2] [--json bench/results/engine.json]``.
These machines are shared and noisy: compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hotloop_serve.engine import ChatMessage, Engine, EngineOptions, SamplingSettings
from hotloop_serve.serve.model_source import embedded_model_path

LONG_TEXT = " ".join(
    f"Paragraph {i}: the harbour town kept its lighthouse lit through {i + 3} winters, and the keeper wrote "
    f"down the ships, the weather and the price of fish in a ledger numbered {i * 7}."
    for i in range(48)
)


def row(name: str, value: float, unit: str, baseline: float | None = None, target: str = "") -> dict[str, Any]:
    ratio = f"{value / baseline:.2f}x" if baseline else ""
    print(f"| {name:<52} | {value:>10.2f} {unit:<6} | {ratio:>7} | {target:<8} |")
    return {"name": name, "value": value, "unit": unit, "ratio": value / baseline if baseline else None}


def raw_llama_decode_isolated(tokens: int, threads: int) -> float:
    """Run the baseline in its own process: llama.cpp's CPU thread pool outlives a freed
    ``Llama`` and slowed the engine measured after it in the same process by a third."""
    out = subprocess.run(
        [sys.executable, __file__, "--raw-only", "--tokens", str(tokens), "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def raw_llama_decode(path: Path, tokens: int, threads: int) -> float:
    """Baseline: the high-level class, one stream, decode speed after the first token."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = "<start_of_turn>user\nWrite a long story about the sea.<end_of_turn>\n<start_of_turn>model\n"
    best = 0.0
    for _ in range(2):
        first = 0.0
        n = 0
        for _chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0, stream=True):
            n += 1
            if n == 1:
                first = time.perf_counter()
        best = max(best, (n - 1) / (time.perf_counter() - first))
    del llm
    return best


def engine_single(engine: Engine, tokens: int) -> float:
    s = SamplingSettings(temperature=0, sample_len=tokens)
    best = 0.0
    for i in range(2):
        history = [ChatMessage("user", "Write a long story about the sea.")]
        r = engine.generate(f"single{i}", "bench", history, s).result()
        assert r.usage is not None and r.timings is not None
        best = max(best, (r.usage.completion_tokens - 1) / (r.timings.decode_ms / 1e3))
    return best


def engine_aggregate(engine: Engine, sessions: int, tokens: int) -> float:
    s = SamplingSettings(temperature=0.8, seed=1, sample_len=tokens)
    prompts = [[ChatMessage("user", f"Tell story number {i} about a different animal.")] for i in range(sessions)]
    # Prefill first (warmup), so the figure is decode throughput, not prompt processing.
    for i, p in enumerate(prompts):
        engine.warmup(f"agg{sessions}-{i}", "bench", p).result()
    t0 = time.perf_counter()
    streams = [engine.generate(f"agg{sessions}-{i}", "bench", p, s) for i, p in enumerate(prompts)]
    total = 0
    for st in streams:
        r = st.result()
        assert r.usage is not None
        total += r.usage.completion_tokens
    return total / (time.perf_counter() - t0)


def long_history() -> list[ChatMessage]:
    return [
        ChatMessage("system", "You are a careful assistant."),
        ChatMessage("user", LONG_TEXT + "\nSummarise this."),
        ChatMessage("assistant", "The keeper logged ships, weather and fish prices for many winters."),
        ChatMessage("user", "What did he record?"),
    ]


def follow_up_ttft(engine: Engine) -> tuple[float, float, int]:
    s = SamplingSettings(temperature=0, sample_len=8)
    history = long_history()
    first = engine.generate("hot", "bench", history, s).result()
    history = [*history, ChatMessage("assistant", first.text), ChatMessage("user", "And then?")]
    time.sleep(0.1)
    hot = engine.generate("hot", "bench", history, s).result()
    cold = engine.generate("cold", "someone-else", history, s).result()  # another owner: no prefix copy
    assert hot.timings and cold.timings and hot.usage
    return hot.timings.time_to_first_token_ms, cold.timings.time_to_first_token_ms, hot.usage.prompt_tokens


def restore_vs_recompute(path: Path, threads: int) -> tuple[float, float, float]:
    """Two engines with one hot sequence: the second session evicts the first to RAM (or drops it)."""
    s = SamplingSettings(temperature=0, sample_len=8)
    results = []
    per_token = 0.0
    for budget in (1 << 30, 0):
        opts = EngineOptions(hot_sessions=1, threads=threads, evicted_bytes=budget)
        with Engine(str(path), opts) as e:
            history = long_history()
            first = e.generate("a", "bench", history, s).result()
            history = [*history, ChatMessage("assistant", first.text), ChatMessage("user", "And then?")]
            e.generate("b", "bench", [ChatMessage("user", "Something else entirely.")], s).result()
            time.sleep(0.1)
            if budget:
                st = e.stats()
                per_token = st.evicted_bytes / max(1, e.session_info("a", "bench").context_tokens)
            again = e.generate("a", "bench", history, s).result()
            assert again.timings is not None
            results.append(again.timings.time_to_first_token_ms)
    return results[0], results[1], per_token


def telemetry_overhead(path: Path, tokens: int, threads: int) -> tuple[float, float]:
    from hotloop.v1 import common_pb2, session_pb2
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from hotloop_serve.config import Config
    from hotloop_serve.serve.auth import Authenticator
    from hotloop_serve.serve.servicer import ModelServicer
    from hotloop_serve.serve.session_ids import SessionIds
    from hotloop_serve.telemetry import Telemetry

    config = Config()
    speeds = []
    with Engine(str(path), EngineOptions(threads=threads)) as e:
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        on = Telemetry("m", "r", e.stats, tp, MeterProvider(metric_readers=[InMemoryMetricReader()]))
        off = Telemetry("m", "r", e.stats)  # the API's no-op providers: nothing installed
        for label, tel in (("off", off), ("on", on), ("off", off), ("on", on)):
            svc = ModelServicer(config, config.models[0], e, SessionIds(b"k", "m"), Authenticator({}), tel)

            async def run(svc: ModelServicer = svc) -> float:
                sess = await svc.CreateSession(session_pb2.CreateSessionRequest(session_key=f"bench-{time.time_ns()}"))
                msgs = [common_pb2.Message(role=common_pb2.ROLE_USER, content="Write a long story about the sea.")]
                req = session_pb2.GenerateRequest(
                    session_id=sess.id, messages=msgs, settings={"temperature": 0, "sample_len": tokens}
                )
                n = 0
                t0 = 0.0
                async for chunk in svc.Generate(req):
                    if not t0:
                        t0 = time.perf_counter()
                    n = chunk.usage.completion_tokens or n
                return (n - 1) / (time.perf_counter() - t0)

            speeds.append((label, asyncio.run(run())))
    off_speed = max(v for k, v in speeds if k == "off")
    on_speed = max(v for k, v in speeds if k == "on")
    return off_speed, on_speed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    ns = ap.parse_args()
    path = embedded_model_path(progress=True)
    if ns.raw_only:
        print(raw_llama_decode(path, ns.tokens, ns.threads))
        return 0
    print(f"model {path.name}, {ns.threads} threads, {ns.tokens} tokens per reply\n")
    print(f"| {'figure':<52} | {'value':>17} | {'ratio':>7} | {'target':<8} |")
    print(f"|{'-' * 54}|{'-' * 19}|{'-' * 9}|{'-' * 10}|")
    rows = []
    raw = raw_llama_decode_isolated(ns.tokens, ns.threads)
    rows.append(row("1. raw llama_cpp.Llama single stream (baseline)", raw, "tok/s"))
    with Engine(str(path), EngineOptions(threads=ns.threads, context_tokens=32768)) as engine:
        single = engine_single(engine, ns.tokens)
        rows.append(row("2. engine single stream", single, "tok/s", raw, ">= 1.0x"))
        for n in (1, 2, 4, 8):
            agg = engine_aggregate(engine, n, ns.tokens)
            target = ">= 2.5x" if n == 8 else ""
            rows.append(row(f"3. engine aggregate, {n} sessions (vs 2.)", agg, "tok/s", single, target))
        hot, cold, n_prompt = follow_up_ttft(engine)
        rows.append(row(f"4. follow-up TTFT cold, {n_prompt}-token history", cold, "ms"))
        rows.append(row("4. follow-up TTFT hot session (cold / hot)", hot, "ms"))
        print(f"|   {'speed-up hot vs cold':<50} | {cold / hot:>10.1f} x      |         | >= 10x   |")
    restore, recompute, per_token = restore_vs_recompute(path, ns.threads)
    rows.append(row("5. after eviction: recompute TTFT", recompute, "ms"))
    rows.append(row("5. after eviction: restore-from-RAM TTFT", restore, "ms"))
    print(f"|   {'speed-up restore vs recompute':<50} | {recompute / restore:>10.1f} x      |         | >= 5x    |")
    rows.append(row("6. KV bytes per cached token", per_token / 1024, "KiB"))
    rows.append(row(f"6. KV MiB per hot session at {n_prompt} tokens", per_token * n_prompt / 2**20, "MiB"))
    off, on = telemetry_overhead(path, ns.tokens, ns.threads)
    rows.append(row("7. servicer single stream, telemetry off", off, "tok/s"))
    rows.append(row("7. servicer single stream, telemetry on (SDK)", on, "tok/s", off))
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"threads": ns.threads, "tokens": ns.tokens, "rows": rows}, indent=2))
    print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

