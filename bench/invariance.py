"""Batch invariance on this machine's llama.cpp CPU kernels, and what the engine pays to keep it.

Why: ``EngineOptions.batch_invariant`` runs the rows that make logits (decoders, a reply's last
prompt token) in a ``llama_decode`` of their own, apart from the step's prompt rows. This bench
shows why (part 1: how a row's logits move with the number of rows in its ``llama_decode``) and
what it costs (part 2: a step of 7 decoders plus a prompt chunk as one call, the baseline, and
as two calls, measured alternately in the same run). It uses the engine's own context settings
(flash attention on, weights not repacked, one unified KV cache) through llama-cpp-python's
low-level API, so the rows of each call are exactly the ones listed.

    .venv/bin/python bench/invariance.py                 # writes bench/results/invariance.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import primitive_context
from harness import RESULTS, machine_facts

from hotloop_serve.engine.model import Model
from hotloop_serve.serve.model_source import embedded_model_path

Row = tuple[int, int, int, bool]  # sequence, position, token, logits wanted
ROW_COUNTS = (1, 2, 4, 7, 8, 16, 32, 63, 64, 128)
PROMPT_ROWS = (2, 10, 30, 60)
DECODERS = 7


class Probe:
    """A context shaped as the engine's (``engine.primitive_context``), driven row by row."""

    def __init__(self, model: Model, threads: int) -> None:
        self.model = model
        self.ctx, self.batch = primitive_context(model, threads)
        self.mem = ll.llama_get_memory(self.ctx)

    def decode(self, rows: list[Row]) -> list[np.ndarray]:
        """One llama_decode of ``rows``; the logits of the rows that want them."""
        b = self.batch
        for i, (seq, pos, tok, wants) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, wants
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        n_vocab = self.model.n_vocab
        return [
            np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(n_vocab,)).copy()
            for i, r in enumerate(rows)
            if r[3]
        ]

    def clear(self) -> None:
        ll.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)


def prompt_rows(seq: int, tokens: list[int], start: int = 0) -> list[Row]:
    return [(seq, start + k, t, False) for k, t in enumerate(tokens)]


def logits_by_row_count(probe: Probe, prompt: list[int], other: list[int]) -> list[dict[str, Any]]:
    """A prompt's last-token logits when its llama_decode holds N rows (the others: another
    sequence's prompt rows), against N = 1; and the whole prompt in one call, as the engine
    did before it decoded the last token apart."""
    out: list[dict[str, Any]] = []

    def last_token_logits(extra: int, whole: bool) -> np.ndarray:
        probe.clear()
        probe.decode(prompt_rows(1, other))
        others = [(1, len(other) + k, other[k % len(other)], False) for k in range(extra)]
        if whole:
            rows = prompt_rows(0, prompt)
        else:
            probe.decode(prompt_rows(0, prompt[:-1]))
            rows = []
        rows.append((0, len(prompt) - 1, prompt[-1], True))
        return probe.decode(rows + others)[0]

    alone = last_token_logits(0, whole=False)
    for whole in (False, True):
        for n in ROW_COUNTS:
            got = last_token_logits(n - 1, whole)
            rows = n - 1 + (len(prompt) if whole else 1)
            out.append(
                {
                    "rows": rows,
                    "last_token": "with its prompt" if whole else "apart",
                    "max_abs_diff": float(np.abs(got - alone).max()),
                    "argmax_same": bool(got.argmax() == alone.argmax()),
                }
            )
    return out


def split_cost(probe: Probe, context: list[int], reps: int) -> list[dict[str, Any]]:
    """A step of ``DECODERS`` decoders and a prompt chunk ending in a reply's last token: one
    call (the baseline) against the body first, then the decoders and the last token."""
    decoders: list[Row] = [(s, len(context), context[0], True) for s in range(1, DECODERS + 1)]
    out: list[dict[str, Any]] = []
    for n in PROMPT_ROWS:
        body = [(0, 10 + k, context[k % len(context)], False) for k in range(n - 1)]
        last: Row = (0, 10 + n - 1, context[(n - 1) % len(context)], True)
        one: list[float] = []
        two: list[float] = []
        for _ in range(reps):
            for split, times in ((False, one), (True, two)):  # alternate, so drift hits both
                probe.clear()
                for s in range(1, DECODERS + 1):
                    probe.decode(prompt_rows(s, context))
                probe.decode(prompt_rows(0, context[:10]))
                t0 = time.perf_counter()
                if split:
                    probe.decode(body)
                    probe.decode([*decoders, last])
                else:
                    probe.decode([*decoders, *body, last])
                times.append(time.perf_counter() - t0)
        a, b = statistics.median(one), statistics.median(two)
        out.append({"prompt_rows": n, "one_call_ms": 1000 * a, "two_calls_ms": 1000 * b, "ratio": b / a})
    return out


def markdown(regimes: list[dict[str, Any]], costs: list[dict[str, Any]], facts: dict[str, Any]) -> str:
    lines = [
        "# Batch invariance: logits by rows per llama_decode, and the cost of the split",
        "",
        f"Machine: {facts.get('cpu', '?')}, {facts.get('cores', '?')} cores. Gemma 3 270M Q4_K_M, "
        "flash attention on, weights not repacked (the engine's batch_invariant context).",
        "",
        "## 1. A prompt's last-token logits against the same token decoded alone (1 row)",
        "",
        "| rows in its llama_decode | last token | max abs logit diff | same argmax |",
        "|---:|---|---:|---|",
    ]
    for r in regimes:
        lines.append(f"| {r['rows']} | {r['last_token']} | {r['max_abs_diff']:.4f} | {r['argmax_same']} |")
    lines += [
        "",
        f"## 2. One step: {DECODERS} decoders + a prompt chunk ending in a reply's last token",
        "",
        "| prompt rows | one call (baseline) ms | body, then decoders + last token ms | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for c in costs:
        lines.append(f"| {c['prompt_rows']} | {c['one_call_ms']:.1f} | {c['two_calls_ms']:.1f} | {c['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=8, help="timed steps per variant and prompt size (default 8)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    model = Model(embedded_model_path(progress=False), repack=False)
    probe = Probe(model, args.threads)
    try:
        prompt = model.tokenize(
            "<start_of_turn>user\nCount from one to five.<end_of_turn>\n<start_of_turn>model\n", add_special=True
        )
        other = model.tokenize(
            "<start_of_turn>user\nWrite a long story about a dragon and a knight who become friends."
            "<end_of_turn>\n<start_of_turn>model\n",
            add_special=True,
        )
        regimes = logits_by_row_count(probe, prompt, other)
        costs = split_cost(probe, other, args.reps)
    finally:
        probe.close()
        model.close()
    report = markdown(regimes, costs, machine_facts())
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "invariance.md").write_text(report)
    (args.out / "invariance.json").write_text(json.dumps({"regimes": regimes, "split_cost": costs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
