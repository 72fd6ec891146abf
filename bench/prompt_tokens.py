#!/usr/bin/env python3
"""A follow-up's prompt tokens: the whole history tokenized (the baseline) against only the text
past the previous turn's prompt (``engine.prompt_tokens.PromptTokenizer``), by history length.

Every turn carries the whole history and is tokenized on the request's critical path, before
the engine sees it. Rows: conversations of the chat workload's shape (``workload.py``: a long
first message, then short turns) grown to ~1,000 / 4,000 / 8,000 tokens; for each, the time to
tokenize the next turn's prompt whole and incrementally (median of ``--repeats``), on one idle
core. Both give the same tokens (checked here, and in ``tests/unit/test_prompt_tokens.py``).

Run: ``.venv/bin/python bench/prompt_tokens.py [--repeats 50]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import WorkloadSpec, build_workload

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate, builtin_template
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.prompt_tokens import PromptTokenizer
from hotloop_serve.serve.model_source import embedded_model_path

REPLY = "Here is what I found about it, step by step, with the details you asked for. " * 3


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ns = ap.parse_args()
    model = Model(embedded_model_path(progress=True), repack=False)
    source = model.metadata.chat_template or builtin_template(model.metadata.architecture)[1]
    template = ChatTemplate(source, "bench", model.token_text(model.bos), model.token_text(model.eos))
    first = build_workload(WorkloadSpec()).sessions[0].history(1, [])
    history = [ChatMessage(role, text) for role, text in first]
    print(f"model {model.path.name}; median of {ns.repeats}\n")
    print("| history (tokens) | whole history (baseline) | past the previous prompt | speed-up |")
    print("|---:|---:|---:|---:|")
    turn = 0
    for target in (1_000, 4_000, 8_000):
        while len(model.tokenize(template.render(history))) < target:
            turn += 1
            history += [ChatMessage("assistant", REPLY), ChatMessage("user", f"And what about point {turn}?")]
        previous = template.render(history)
        follow = [*history, ChatMessage("assistant", REPLY), ChatMessage("user", "Thanks. One more question?")]
        text = template.render(follow)
        whole = median_ms(lambda text=text: model.tokenize(text), ns.repeats)
        prompts = PromptTokenizer(model)
        prompts.tokenize(previous, "s")
        assert prompts.tokenize(text, "s") == model.tokenize(text)
        timed = []
        for _ in range(ns.repeats):
            prompts.tokenize(previous, "s")  # the previous turn's prompt, as the engine kept it
            t = time.perf_counter()
            prompts.tokenize(text, "s")
            timed.append((time.perf_counter() - t) * 1e3)
        inc = statistics.median(timed)
        n = len(model.tokenize(text))
        print(f"| {n:,} | {whole:.2f} ms | {inc:.2f} ms | {whole / inc:.0f}x |")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
