#!/usr/bin/env python3
"""Session operations benchmark: what a fork, a restore and a resume cost, side by side, in one run.

For histories of about 1,000 and 4,000 tokens (bundled Gemma 3 270M), each row against the
same-run baseline of prefilling that history cold:

- fork: ``Engine.fork_session`` of a hot session (KV cells shared, ``seq_cp``) and of an
  evicted one (state copied), vs prefilling the same history (target: <= 5%)
- the next turn's time to first token after: a hot follow-up, a restore from host RAM, a
  restore from the disk tier (after an engine restart), and a cold recompute (targets for
  disk: <= 2x hot and <= 1/10 of cold)
- export / import: blob size and time

Run: ``.venv/bin/python bench/sessions.py [--threads 2] [--json bench/results/sessions.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hotloop_serve.engine import ChatMessage, Engine, EngineOptions, SamplingSettings
from hotloop_serve.engine.persist import BlobKeys
from hotloop_serve.serve.model_source import embedded_model_path

S = SamplingSettings(temperature=0, sample_len=4, repeat_penalty=1.0)
ROWS: list[dict[str, Any]] = []


def history(words: int) -> list[ChatMessage]:
    text = " ".join(f"Note {i}: the tide table for pier {i % 17} reads {i * 7 % 23} feet." for i in range(words // 10))
    return [ChatMessage("system", "You are a careful assistant."), ChatMessage("user", text + "\nSummarise this.")]


def row(name: str, ms: float, base: float | None = None, target: str = "") -> None:
    ratio = f"{ms / base:.3f}x" if base else ""
    print(f"| {name:<58} | {ms:>10.1f} ms | {ratio:>8} | {target:<14} |")
    ROWS.append({"name": name, "ms": ms, "ratio": ms / base if base else None})


LAST: dict[str, str] = {}


def ttft(e: Engine, sid: str, msgs: list[ChatMessage]) -> tuple[float, Any]:
    r = e.generate(sid, "bench", msgs, S).result()
    assert r.timings is not None and r.usage is not None
    LAST[sid] = r.text
    return r.timings.time_to_first_token_ms, r.usage


def reply(sid: str, msgs: list[ChatMessage], user: str) -> list[ChatMessage]:
    """The history a chat client sends next: the reply it got, then a new question."""
    return [*msgs, ChatMessage("assistant", LAST[sid]), ChatMessage("user", user)]


def settle(e: Engine) -> None:
    while e.stats().active_requests:
        time.sleep(0.01)


def measure(path: Path, words: int, threads: int) -> None:
    msgs = history(words)
    with tempfile.TemporaryDirectory() as disk:
        opts = EngineOptions(threads=threads, context_tokens=16384, hot_sessions=4, persist_dir=disk)
        keys = BlobKeys.ephemeral()  # both engines below are one server, before and after a restart
        with Engine(str(path), opts, blob_keys=keys) as e:
            cold, usage = ttft(e, "a", msgs)
            n = usage.prompt_tokens
            settle(e)
            print(f"| {'history of ' + str(n) + ' tokens':<58} | {'':>13} | {'':>8} | {'':<14} |")
            row("cold prefill, first token (baseline)", cold)
            t0 = time.perf_counter()
            e.fork_session("a", "bench", "fork-hot")
            row("fork of a hot session (seq_cp)", (time.perf_counter() - t0) * 1e3, cold, "<= 0.05x")
            follow = reply("a", msgs, "And then?")
            hot, _ = ttft(e, "a", follow)
            settle(e)
            fork_next, fu = ttft(e, "fork-hot", follow)
            assert fu.cached_tokens >= n - 1, fu
            settle(e)
            t0 = time.perf_counter()
            blob = e.export_session("a", "bench")
            export_ms = (time.perf_counter() - t0) * 1e3
            for i in range(4):  # push "a" out of the sequences into host RAM
                e.generate(f"filler{i}", "bench", [ChatMessage("user", f"filler {i}")], S).result()
                settle(e)
            assert e.session_info("a", "bench").state == "evicted"
            t0 = time.perf_counter()
            e.fork_session("a", "bench", "fork-evicted")
            row("fork of an evicted session (state copy)", (time.perf_counter() - t0) * 1e3, cold, "<= 0.05x")
            third = reply("a", follow, "More?")
            ram, ru = ttft(e, "a", third)
            assert ru.restored_tokens > 0, ru
            settle(e)
            t0 = time.perf_counter()
            e.import_session("imported", "bench", blob)
            import_ms = (time.perf_counter() - t0) * 1e3
        final = reply("a", third, "Last?")
        with Engine(str(path), opts, blob_keys=keys) as e2:  # a restart: "a" comes back from the disk tier
            disk_ttft, du = ttft(e2, "a", final)
            assert du.restored_tokens > 0 and e2.stats().disk_restores == 1, du
    row("next turn: hot follow-up TTFT", hot, cold)
    row("next turn of the hot fork TTFT", fork_next, cold)
    row("next turn after eviction: restore from RAM TTFT", ram, cold)
    row("next turn after a restart: restore from disk TTFT", disk_ttft, cold, "<= 0.1x, <= 2x hot")
    print(f"|   {'disk / hot':<56} | {disk_ttft / hot:>10.2f} x  |          |                |")
    row(f"export ({len(blob) / 2**20:.1f} MiB blob)", export_ms, cold)
    row("import (verify + restore)", import_ms, cold)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "sessions.json")
    ns = ap.parse_args()
    path = embedded_model_path(progress=True)
    print(f"model {path.name}, {ns.threads} threads\n")
    print(f"| {'figure':<58} | {'value':>13} | {'vs cold':>8} | {'target':<14} |")
    print(f"|{'-' * 60}|{'-' * 15}|{'-' * 10}|{'-' * 16}|")
    for words in (750, 3000):
        measure(path, words, ns.threads)
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"threads": ns.threads, "rows": ROWS}, indent=2))
    print(f"\nwrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
