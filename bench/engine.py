#!/usr/bin/env python3
"""Engine benchmark: the figures of the engine issues, side by side, in one run.

0. the primitive: llama.cpp's low-level batched loop (one ``llama_decode`` per step for n
   sequences, greedy, no penalty) vs the engine at 1/2/4/8 sessions with identical settings
   and a fixed reply length; the ratio engine / primitive (target >= 0.95 at every width)
0b. repeat penalty on (with and without the exact top-k prefilter) vs off, 8 sessions; the
    sampler chain over the candidates that decide the draw vs over the whole vocabulary
0c. KV layout (unified / per-session streams, full-size SWA cache or not) and KV types
    (f16, q8_0) at 8 sessions x ~1,000-token contexts: tok/s, KV MiB per session, greedy
    agreement with the default
0d. a hot follow-up's TTFT while a 4,000-token cold prompt prefills, vs alone
0f. one 512-row prefill step of 8 prompts, each with 1,024 cells of history in a unified pool,
    by the layout of its pieces: 67-69 rows each (the baseline: pieces across flash attention's
    64-row query tiles), whole 64-row tiles (the scheduler's layout), and whole tiles whose
    sequences' KV cells sit off the 64-cell grid (a 49-token prefix copied to all of them)
0e. one session's time between tokens (p50/p99) while 3 newcomers prefill ~1,500-token
    prompts, and the newcomers' mean TTFT, per ``step_target_ms`` (0 = fixed prefill chunk,
    the baseline): the pacing trade-off, both sides
0g. deterministic mode (``EngineOptions.deterministic``) against the default, per-session
    streams both (the mode requires them) and the unified default: single-stream decode,
    8 sessions decoding, a ~2,060-token cold prompt's TTFT and a hot follow-up's
1. raw ``llama_cpp.Llama`` single-stream decode tokens/s (the high-level baseline)
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
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import percentile

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


FIXED_PROMPT = "Count slowly from one to five hundred, one number per line, in words: one, two, three,"
WIDTHS = (1, 2, 4, 8)


def primitive_isolated(tokens: int, threads: int, width: int, history: int = 0) -> float:
    """The primitive at one width, in its own process, right before the engine row it is compared to."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            *("--primitive-only", str(width), "--tokens", str(tokens), "--threads", str(threads)),
            *("--history", str(history)),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def primitive_context(model: Any, threads: int) -> tuple[Any, Any]:
    """A raw llama.cpp context shaped as the engine's (16k cells, 8 sequences, 512-token
    batches, unified KV, full-size SWA cache, flash attention) and a 512-token batch."""
    import llama_cpp as ll

    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 16384, 512, 512, 8
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified, params.swa_full, params.no_perf = True, True, True
    params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    return ll.llama_init_from_model(model.ptr, params), ll.llama_batch_init(512, 0, 1)


def primitive(
    path: Path, tokens: int, threads: int, widths: tuple[int, ...] = WIDTHS, history: int = 0
) -> dict[int, float]:
    """llama.cpp's low-level batched loop: n sequences, one token each per llama_decode, greedy.

    The same context shape, template and prompts as the engine rows; decode tokens/s counted
    from each sequence's first sampled token, as the engine's timings do. ``history`` > 0: each
    sequence's prompt is padded to that many tokens first (decoding attends over all of them).
    """
    import llama_cpp as ll

    from hotloop_serve.engine.model import Model

    model = Model(path, repack=False)
    engine_tokens = None
    results: dict[int, float] = {}
    for n in widths:
        ctx, batch = primitive_context(model, threads)
        samplers = []
        last = []
        for seq in range(n):
            text = f"<start_of_turn>user\n{FIXED_PROMPT} (list {seq})<end_of_turn>\n<start_of_turn>model\n"
            body = model.tokenize(text)
            pad = model.tokenize(" ".join(f"{FIXED_PROMPT} ({seq}.{i})" for i in range(history // 8)))
            engine_tokens = [model.bos, *pad[: max(0, history - len(body) - 1)], *body]
            for start in range(0, len(engine_tokens), 512):
                part = engine_tokens[start : start + 512]
                for i, t in enumerate(part):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
                    batch.logits[i] = start + i == len(engine_tokens) - 1
                    batch.seq_id[i][0] = seq
                batch.n_tokens = len(part)
                assert ll.llama_decode(ctx, batch) == 0
            chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            samplers.append(chain)
            last.append((ll.llama_sampler_sample(chain, ctx, batch.n_tokens - 1), len(engine_tokens)))
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            for seq, (tok, pos) in enumerate(last):
                batch.token[seq], batch.pos[seq], batch.n_seq_id[seq], batch.logits[seq] = tok, pos, 1, True
                batch.seq_id[seq][0] = seq
            batch.n_tokens = n
            assert ll.llama_decode(ctx, batch) == 0
            last = [(ll.llama_sampler_sample(samplers[seq], ctx, seq), pos + 1) for seq, (_, pos) in enumerate(last)]
        results[n] = n * (tokens - 1) / (time.perf_counter() - t0)
        for chain in samplers:
            ll.llama_sampler_free(chain)
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    model.close()
    return results


def primitive_prefill(path: Path, threads: int, tokens: int = 2048, sequences: int = 2) -> float:
    """llama.cpp's prefill rate: ``sequences`` histories of ``tokens`` tokens each, decoded in
    512-token batches into one context (as a chat's cold turns are), prompt tokens/s."""
    import llama_cpp as ll

    from hotloop_serve.engine.model import Model

    model = Model(path, repack=False)
    ctx, batch = primitive_context(model, threads)
    text = " ".join(f"{FIXED_PROMPT} ({i})" for i in range(400))
    history = [model.bos, *model.tokenize(text)][:tokens]
    assert len(history) == tokens, "the filler text is too short"
    t0 = time.perf_counter()
    for seq in range(sequences):
        for start in range(0, tokens, 512):
            part = history[start : start + 512]
            for i, t in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, start + i, 1, False
                batch.seq_id[i][0] = seq
            batch.logits[len(part) - 1] = True
            batch.n_tokens = len(part)
            assert ll.llama_decode(ctx, batch) == 0
    rate = sequences * tokens / (time.perf_counter() - t0)
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    model.close()
    return rate


def prefill_tiles(path: Path, threads: int, history: int = 1024, repeats: int = 3) -> list[dict[str, Any]]:
    """Rows 0f: the same 512 prompt rows of 8 sequences in one ``llama_decode``, by piece layout.

    llama.cpp's CPU flash attention works on 64-row query tiles against 64-cell KV tiles and
    skips a KV tile only when it is masked for every row of the query tile: a tile with rows of
    two prompts computes both prompts' KV tiles. Each layout is timed on a pool filled the same
    way, the step's cells removed again after each timing (best of ``repeats``).
    """
    import llama_cpp as ll

    from hotloop_serve.engine.model import Model

    model = Model(path, repack=False)
    ctx, batch = primitive_context(model, threads)
    memory = ll.llama_get_memory(ctx)
    text = " ".join(f"{FIXED_PROMPT} ({i})" for i in range(400))
    tokens = [model.bos, *model.tokenize(text)]

    def decode(pieces: list[tuple[int, int]], pos: dict[int, int]) -> float:
        n = 0
        for seq, count in pieces:
            for k in range(count):
                p = pos[seq] + k
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = tokens[p % 2000], p, 1, False
                batch.seq_id[n][0] = seq
                n += 1
            pos[seq] += count
        batch.logits[n - 1] = True
        batch.n_tokens = n
        t0 = time.perf_counter()
        assert ll.llama_decode(ctx, batch) == 0
        return time.perf_counter() - t0

    def fill(shared: int) -> dict[int, int]:
        ll.llama_memory_clear(memory, True)
        pos = dict.fromkeys(range(8), 0)
        if shared:  # a common prefix, copied to every sequence as the engine copies one
            decode([(0, shared)], pos)
            for seq in range(1, 8):
                ll.llama_memory_seq_cp(memory, 0, seq, 0, shared)
                pos[seq] = shared
        while pos[7] < history:
            decode([(seq, 64) for seq in range(8)], pos)
        return pos

    def step(pos: dict[int, int], pieces: list[tuple[int, int]]) -> float:
        best = float("inf")
        for _ in range(repeats):
            before = dict(pos)
            best = min(best, decode(pieces, pos))
            for seq in range(8):
                ll.llama_memory_seq_rm(memory, seq, before[seq], -1)
            pos.update(before)
        return 512 / best

    odd = [(0, 32), (1, 67), (2, 69), (3, 69), (4, 68), (5, 69), (6, 69), (7, 69)]
    whole = [(seq, 64) for seq in range(8)]
    try:
        pos = fill(0)
        base = step(pos, odd)
        aligned = step(pos, whole)
        off_grid = step(fill(49), whole)
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        model.close()
    return [
        row(f"0f. 512-row step, pieces of 67-69 rows, {history} history", base, "tok/s"),
        row("0f. same, whole 64-row pieces (vs 67-69)", aligned, "tok/s", base),
        row("0f. same, whole pieces, KV off the 64-cell grid", off_grid, "tok/s", base),
    ]


def burst_by_tiles(path: Path, threads: int, prompts: int = 5, rounds: int = 2) -> list[dict[str, Any]]:
    """Row 0f: ``prompts`` first turns at once on a fresh engine, prompt tokens/s until the last
    one's first token, with the scheduler's whole-tile pieces and without (the baseline)."""
    from hotloop_serve.engine import runner, scheduler

    tile = scheduler.PREFILL_TILE
    greedy = SamplingSettings(temperature=0, sample_len=1)
    text = LONG_TEXT[:4000]
    histories = [[ChatMessage("user", f"Reader {i}: {text}{text[: 200 * i]}\nSummarise this.")] for i in range(prompts)]
    rates: dict[int, list[float]] = {1: [], tile: []}
    try:
        for _, size in itertools.product(range(rounds), (1, tile)):
            runner.PREFILL_TILE = scheduler.PREFILL_TILE = size
            with Engine(str(path), EngineOptions(threads=threads, context_tokens=32768)) as engine:
                t0 = time.perf_counter()
                streams = [engine.generate(f"b{i}", f"p{i}", h, greedy) for i, h in enumerate(histories)]
                done = [st.result() for st in streams]
                rates[size].append(sum(r.usage.prefilled_tokens for r in done if r.usage) / (time.perf_counter() - t0))
    finally:
        runner.PREFILL_TILE = scheduler.PREFILL_TILE = tile
    base, tiled = max(rates[1]), max(rates[tile])
    return [
        row(f"0f. engine, {prompts} first turns at once, pieces as before", base, "tok/s"),
        row("0f. same, whole-tile pieces (vs before)", tiled, "tok/s", base),
    ]


def primitive_prefill_isolated(threads: int) -> float:
    """:func:`primitive_prefill` in its own process (see :func:`raw_llama_decode_isolated`)."""
    out = subprocess.run(
        [sys.executable, __file__, "--prefill-only", "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def fixed_run(engine: Engine, n: int, tokens: int, settings: SamplingSettings, tag: str) -> tuple[float, list[str]]:
    """n sessions at once, prompts prefilled first; aggregate decode tokens/s and the texts."""
    prompts = [[ChatMessage("user", f"{FIXED_PROMPT} (list {i})")] for i in range(n)]
    for i, p in enumerate(prompts):
        engine.warmup(f"{tag}{n}-{i}", "bench", p).result()
    streams = [engine.generate(f"{tag}{n}-{i}", "bench", p, settings) for i, p in enumerate(prompts)]
    results = [st.result() for st in streams]
    total = sum(r.usage.completion_tokens - 1 for r in results if r.usage)
    span = max((r.timings.decode_ms for r in results if r.timings), default=1.0) / 1e3
    return total / span, [r.text for r in results]


def engine_vs_primitive(path: Path, tokens: int, threads: int) -> list[dict[str, Any]]:
    rows = []
    greedy = SamplingSettings(temperature=0, sample_len=tokens, repeat_penalty=1.0)
    with Engine(str(path), EngineOptions(threads=threads, context_tokens=16384)) as engine:
        for n in WIDTHS:
            prim = primitive_isolated(tokens, threads, n)
            rows.append(row(f"0. primitive batched loop, {n} seq", prim, "tok/s"))
            got, _ = fixed_run(engine, n, tokens, greedy, "fixed")
            rows.append(row(f"0. engine, {n} sessions (vs primitive)", got, "tok/s", prim, ">= 0.95x"))
        off, _ = fixed_run(engine, 8, tokens, greedy, "pen-off")
        rows.append(row("0b. 8 sessions, repeat penalty off", off, "tok/s"))
        penalty = greedy.merged(repeat_penalty=1.1, repeat_last_n=64)
        on, _ = fixed_run(engine, 8, tokens, penalty, "pen-on")
        rows.append(row("0b. 8 sessions, penalty 1.1, top-k prefilter (vs off)", on, "tok/s", off))
        from hotloop_serve.engine import sampling

        real = sampling.prefilter_k
        sampling.prefilter_k = lambda s: 0
        try:
            full, _ = fixed_run(engine, 8, tokens, penalty, "pen-full")
        finally:
            sampling.prefilter_k = real
        rows.append(row("0b. 8 sessions, penalty 1.1 over the full vocab (vs off)", full, "tok/s", off))
        rows.extend(sampler_candidates(engine, tokens, off))
    return rows


def sampler_candidates(engine: Engine, tokens: int, greedy_rate: float) -> list[dict[str, Any]]:
    """Row 0b': the sampler chain over the candidates that decide the draw (``decisive_k``:
    argmax for plain greedy, every logit near the best for a top-k chain) vs over the whole
    262k vocabulary (``llama_sampler_sample``, the baseline), 8 sessions, same tokens drawn."""
    from hotloop_serve.engine import sampling

    top_k = SamplingSettings(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=1)
    top_k = top_k.merged(sample_len=tokens)
    decisive, _ = fixed_run(engine, 8, tokens, top_k, "cut-on")
    real = sampling.decisive_k
    sampling.decisive_k = lambda s: 0
    try:
        whole_greedy, _ = fixed_run(
            engine, 8, tokens, SamplingSettings(temperature=0, sample_len=tokens, repeat_penalty=1.0), "cut-off-g"
        )
        whole, _ = fixed_run(engine, 8, tokens, top_k, "cut-off")
    finally:
        sampling.decisive_k = real
    return [
        row("0b'. 8 sessions greedy, sampler over the whole vocab (before)", whole_greedy, "tok/s"),
        row("0b'. 8 sessions greedy, argmax (vs whole vocab)", greedy_rate, "tok/s", whole_greedy),
        row("0b'. 8 sessions top-k 40 / top-p / min-p, whole vocab (before)", whole, "tok/s"),
        row("0b'. 8 sessions top-k 40, decisive candidates (vs whole vocab)", decisive, "tok/s", whole),
    ]


def layouts(path: Path, tokens: int, threads: int) -> list[dict[str, Any]]:
    """8 sessions holding ~1,000-token contexts, decoding together, per KV layout and type."""
    rows = []
    greedy = SamplingSettings(temperature=0, sample_len=tokens, repeat_penalty=1.0)
    history = [ChatMessage("user", LONG_TEXT[: len(LONG_TEXT) * 2 // 3] + f"\n{FIXED_PROMPT}")]
    variants = [
        ("unified, full SWA cache, f16 (default)", {}),
        ("per-session streams, windowed SWA, f16", {"kv_layout": "per_session", "swa_full": False}),
        ("per-session streams, full SWA cache, f16", {"kv_layout": "per_session"}),
        ("unified, full SWA cache, K/V q8_0", {"kv_type_k": "q8_0", "kv_type_v": "q8_0"}),
    ]
    reference: list[str] = []
    base = 0.0
    for label, extra in variants:
        # 3,072 cells a session: the follow-up's ~2,060-token history fits a per-session stream.
        opts = EngineOptions(threads=threads, context_tokens=24576, hot_sessions=8, **extra)  # type: ignore[arg-type]
        with Engine(str(path), opts) as e:
            msgs = [[*history[:-1], ChatMessage("user", history[-1].content + f" (list {i})")] for i in range(8)]
            for i, m in enumerate(msgs):
                e.warmup(f"l{i}", "bench", m).result()
            streams = [e.generate(f"l{i}", "bench", m, greedy) for i, m in enumerate(msgs)]
            res = [s.result() for s in streams]
            total = sum(r.usage.completion_tokens - 1 for r in res if r.usage)
            speed = total / (max(r.timings.decode_ms for r in res if r.timings) / 1e3)
            while e.stats().active_requests:
                time.sleep(0.01)
            ctx_tokens = e.session_info("l0", "bench").context_tokens
            blob_bytes = len(e.export_session("l0", "bench"))  # tokens + llama.cpp's state of the sequence
            texts = [r.text for r in res]
        if not reference:
            reference, base = texts, speed
        agree = sum(a == b for a, b in zip(texts, reference, strict=True)) / len(texts)
        rows.append(row(f"0c. {label}", speed, "tok/s", base if base != speed else None))
        size = blob_bytes / 2**20
        print(f"|   {'  KV MiB/session at ' + str(ctx_tokens) + ' tok; replies equal to default':<50} | "
              f"{size:>8.1f} MiB  | {agree:>6.0%}  |          |")  # fmt: skip
    return rows


def ttft_during_cold_prefill(path: Path, threads: int) -> list[dict[str, Any]]:
    s = SamplingSettings(temperature=0, sample_len=4, repeat_penalty=1.0)
    cold_history = [ChatMessage("user", (LONG_TEXT + " ") * 3 + "Summarise.")]
    with Engine(str(path), EngineOptions(threads=threads, context_tokens=16384)) as e:
        hist = long_history()[:2]
        first = e.generate("hot", "bench", hist, s).result()
        follow = [*hist, ChatMessage("assistant", first.text), ChatMessage("user", "And then?")]
        alone = e.generate("hot", "bench", follow, s).result()
        follow = [*follow, ChatMessage("assistant", alone.text), ChatMessage("user", "More?")]
        cold = e.generate("cold", "other", cold_history, s)
        time.sleep(0.2)  # the cold prompt is prefilling
        during = e.generate("hot", "bench", follow, s).result()
        c = cold.result()
    assert alone.timings and during.timings and c.usage
    return [
        row("0d. hot follow-up TTFT alone", alone.timings.time_to_first_token_ms, "ms"),
        row(
            f"0d. same, while a {c.usage.prompt_tokens}-token cold prompt prefills",
            during.timings.time_to_first_token_ms,
            "ms",
            alone.timings.time_to_first_token_ms,
        ),
    ]


def gaps_while_others_prefill(path: Path, threads: int, target_ms: float, newcomers: int = 3) -> dict[str, float]:
    """A decoding session's gaps between chunks while ``newcomers`` cold prompts prefill."""
    import statistics
    import threading

    opts = EngineOptions(threads=threads, context_tokens=16384, step_target_ms=target_ms)
    decode = SamplingSettings(temperature=0, sample_len=4096, repeat_penalty=1.0)
    short = SamplingSettings(temperature=0, sample_len=2, repeat_penalty=1.0)
    with Engine(str(path), opts) as e:
        stream = e.generate("reader", "bench", [ChatMessage("user", "Count slowly from one.")], decode)
        stamps: list[float] = []
        reading = threading.Thread(target=lambda: stamps.extend(time.perf_counter() for _ in stream), daemon=True)
        reading.start()
        time.sleep(1.5)  # the reader decodes alone: its steps are measured
        t0 = time.perf_counter()
        cold = [
            e.generate(f"new{i}", f"other{i}", [ChatMessage("user", f"Letter {i}. {LONG_TEXT} Summarise.")], short)
            for i in range(newcomers)
        ]
        results = [c.result() for c in cold]
        t1 = time.perf_counter()
        stream.cancel()
        reading.join(timeout=10)
    during = [b - a for a, b in itertools.pairwise(stamps) if a >= t0 and b <= t1]
    ttfts = [r.timings.time_to_first_token_ms for r in results if r.timings]
    prompt = results[0].usage.prompt_tokens if results[0].usage else 0
    p50, p99 = percentile(during, 50) or 0.0, percentile(during, 99) or 0.0
    return {"p50": p50 * 1e3, "p99": p99 * 1e3, "ttft": statistics.fmean(ttfts), "prompt": prompt}


def pacing(path: Path, threads: int) -> list[dict[str, Any]]:
    base = gaps_while_others_prefill(path, threads, 0.0)
    rows = [
        row(f"0e. gap p50, 3 x {base['prompt']:.0f}-token prefills, fixed chunk", base["p50"], "ms"),
        row("0e. gap p99, same (fixed chunk: baseline)", base["p99"], "ms"),
        row("0e. newcomers' mean TTFT, same", base["ttft"], "ms"),
    ]
    for target in (100.0, EngineOptions().step_target_ms, 250.0):
        paced = gaps_while_others_prefill(path, threads, target)
        rows += [
            row(f"0e. gap p50, step_target_ms={target:.0f}", paced["p50"], "ms", base["p50"]),
            row(f"0e. gap p99, step_target_ms={target:.0f}", paced["p99"], "ms", base["p99"]),
            row(f"0e. newcomers' mean TTFT, step_target_ms={target:.0f}", paced["ttft"], "ms", base["ttft"]),
        ]
    return rows


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
                principal = svc.auth.principal([], None)
                create = session_pb2.CreateSessionRequest(session_key=f"bench-{time.time_ns()}")
                sess = await svc.create_session_here(create, principal)
                msgs = [common_pb2.Message(role=common_pb2.ROLE_USER, content="Write a long story about the sea.")]
                settings = common_pb2.Settings(temperature=0, sample_len=tokens)
                req = session_pb2.GenerateRequest(session_id=sess.id, messages=msgs, settings=settings)
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


def deterministic_cost(path: Path, tokens: int, threads: int) -> list[dict[str, Any]]:
    """Row 0g: what ``deterministic`` costs, each option set on a fresh engine, same run."""
    variants = [
        ("unified (default)", {}),
        ("per-session streams", {"kv_layout": "per_session"}),
        ("per-session streams, deterministic", {"kv_layout": "per_session", "deterministic": True}),
    ]
    rows: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    for label, extra in variants:
        # 3,072 cells a session: the follow-up's ~2,060-token history fits a per-session stream.
        opts = EngineOptions(threads=threads, context_tokens=24576, hot_sessions=8, **extra)  # type: ignore[arg-type]
        greedy = SamplingSettings(temperature=0, sample_len=tokens, repeat_penalty=1.0)
        with Engine(str(path), opts) as e:
            figures = {
                "single stream decode": (engine_single(e, tokens), "tok/s"),
                "8 sessions decode": (fixed_run(e, 8, tokens, greedy, "det")[0], "tok/s"),
            }
            hot, cold, n = follow_up_ttft(e)
            figures[f"cold prompt TTFT, {n} tokens"] = (cold, "ms")
            figures["hot follow-up TTFT"] = (hot, "ms")
        for name, (value, unit) in figures.items():
            rows.append(row(f"0g. {name}: {label}", value, unit, base.get(name)))
            base.setdefault(name, value)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--primitive-only", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--history", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--only-new", action="store_true", help="only the rows 0-0e (engine vs primitive, options)")
    ap.add_argument("--pacing-only", action="store_true", help="only the rows 0e (prefill pacing)")
    ap.add_argument("--tiles-only", action="store_true", help="only the rows 0f (prefill pieces vs attention tiles)")
    ap.add_argument("--deterministic-only", action="store_true", help="only the rows 0g (deterministic mode)")
    ap.add_argument("--sampler-only", action="store_true", help="only the rows 0-0b' (engine vs primitive, sampler)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    ns = ap.parse_args()
    path = embedded_model_path(progress=True)
    if ns.raw_only:
        print(raw_llama_decode(path, ns.tokens, ns.threads))
        return 0
    if ns.prefill_only:
        print(primitive_prefill(path, ns.threads))
        return 0
    if ns.primitive_only:
        print(primitive(path, ns.tokens, ns.threads, (ns.primitive_only,), ns.history)[ns.primitive_only])
        return 0
    print(f"model {path.name}, {ns.threads} threads, {ns.tokens} tokens per reply\n")
    print(f"| {'figure':<52} | {'value':>17} | {'ratio':>7} | {'target':<8} |")
    print(f"|{'-' * 54}|{'-' * 19}|{'-' * 9}|{'-' * 10}|")
    if ns.pacing_only:
        return _write(ns, pacing(path, ns.threads))
    if ns.tiles_only:
        return _write(ns, prefill_tiles(path, ns.threads) + burst_by_tiles(path, ns.threads))
    if ns.deterministic_only:
        return _write(ns, deterministic_cost(path, ns.tokens, ns.threads))
    rows = engine_vs_primitive(path, ns.tokens, ns.threads)
    if ns.sampler_only:
        return _write(ns, rows)
    rows += layouts(path, 64, ns.threads)
    rows += ttft_during_cold_prefill(path, ns.threads)
    rows += pacing(path, ns.threads)
    rows += prefill_tiles(path, ns.threads) + burst_by_tiles(path, ns.threads)
    rows += deterministic_cost(path, ns.tokens, ns.threads)
    if ns.only_new:
        return _write(ns, rows)
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
    return _write(ns, rows)


def _write(ns: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"threads": ns.threads, "tokens": ns.tokens, "rows": rows}, indent=2))
    print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
