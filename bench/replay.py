"""The chat workload of ``peer.py`` replayed on the engine in-process, one row per engine variant.

Why: ``peer.py`` measures the whole service; this isolates the engine's scheduling. The same
workload (``workload.py``; ``--workload w1|w2`` are peer.py's presets) runs as threads against
one ``Engine`` (no Ray, no HTTP) with peer.py's engine options (``PEER_ENGINE``), once per
variant given, alternating, so each variant has its same-run baseline. Every step the runner
executes is logged: where the time went by how many sessions decoded in the step (a step with 8
decoding rows is the machine's best decode rate; with 1-3 most of its cost is paid for little),
how much of the wall clock was outside ``llama_decode`` (Python, waiting for clients), and the
roofline the run's totals allow. A turn's phases come from its first chunk's ``Timings``
(queued, prefill), so the report says where first-turn and follow-up TTFT went.

    .venv/bin/python bench/replay.py --workload w2          # the default engine, 2 rounds
    .venv/bin/python bench/replay.py --workload w2 --rounds 1 \
        --variants "batch_invariant=true;batch_invariant=false"

Writes ``bench/results/<name>.md`` and ``<name>.json`` (with every step of every run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import primitive_isolated, primitive_prefill_isolated
from harness import RESULTS, machine_facts, percentile
from peer import PEER_ENGINE, WORKLOADS, engine_overrides
from workload import SessionScript, WorkloadSpec, build_workload

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.runner import ModelRunner, StepOutput
from hotloop_serve.engine.scheduler import Piece
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.serve.model_source import embedded_model_path


class TimedRunner(ModelRunner):
    """The engine's runner, each step logged: (start since ``t0``, decode rows, prefill tokens,
    seconds of the step's ``llama_decode`` calls and logits read-back)."""

    def __init__(self, model: Model, opts: EngineOptions) -> None:
        super().__init__(model, opts)
        self.t0 = time.perf_counter()
        self.steps: list[tuple[float, int, int, float]] = []

    def execute(self, pieces: Sequence[Piece]) -> StepOutput:
        start = time.perf_counter()
        out = super().execute(pieces)
        decode = sum(1 for p in pieces if p.decoding)
        prefill = sum(len(p.tokens) for p in pieces) - decode
        self.steps.append((start - self.t0, decode, prefill, time.perf_counter() - start))
        return out


def replay(model: Path, variant: dict[str, Any], spec: WorkloadSpec, threads: int) -> dict[str, Any]:
    """One run of the workload on a fresh engine; per-turn TTFTs and phases, and the step log."""
    workload = build_workload(spec)
    opts = EngineOptions(**{**PEER_ENGINE, "threads": threads, **variant})  # as peer.py's hotloop rows
    engine = Engine(str(model), opts, runner=TimedRunner)
    runner = engine.runner
    assert isinstance(runner, TimedRunner)
    steps = runner.steps
    turns: list[dict[str, Any]] = []
    lock = threading.Lock()

    def session(script: SessionScript) -> None:
        sid = f"s{script.index}"
        settings = SamplingSettings(
            temperature=spec.temperature,
            sample_len=spec.sample_len,
            seed=script.seed,
            top_k=spec.top_k,
            top_p=spec.top_p,
            min_p=spec.min_p,
            repeat_penalty=spec.repeat_penalty,
        )
        engine.create_session(sid, "bench", settings)
        replies: list[str] = []
        for turn in range(1, spec.turns + 1):
            history = [ChatMessage(role, text) for role, text in script.history(turn, replies)]
            start = time.perf_counter()
            first, text, queue_s = 0.0, "", 0.0
            for chunk in engine.generate(sid, "bench", history):
                if chunk.text and not first:
                    first = time.perf_counter()
                if chunk.timings is not None and not queue_s:
                    queue_s = chunk.timings.queue_ms / 1e3
                text += chunk.text
            with lock:
                turns.append(
                    {
                        "session": script.index,
                        "turn": turn,
                        "start_s": start - t0,
                        "ttft_s": first - start,
                        "queued_s": queue_s,
                    }
                )
            replies.append(text)

    try:
        warm = SamplingSettings(temperature=0, sample_len=4)
        engine.create_session("warm", "bench", warm)
        engine.generate("warm", "bench", [ChatMessage("user", "Hello")]).result()
        engine.close_session("warm", "bench")
        steps.clear()
        t0 = runner.t0 = time.perf_counter()
        workers = [threading.Thread(target=session, args=(s,)) for s in workload.sessions]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    follow = [t["ttft_s"] for t in turns if t["turn"] > 1]
    first = [t["ttft_s"] for t in turns if t["turn"] == 1]
    by_width: dict[int, float] = {}
    for _, width, _, seconds in steps:
        by_width[width] = by_width.get(width, 0.0) + seconds
    busy = sum(s[3] for s in steps)
    return {
        "variant": variant,
        "wall_s": wall,
        "decode_busy_s": busy,
        "first_queued_median_s": statistics.median(t["queued_s"] for t in turns if t["turn"] == 1),
        "followup_queued_median_s": statistics.median(t["queued_s"] for t in turns if t["turn"] > 1),
        "followup_ttft_median_s": statistics.median(follow),
        "followup_ttft_p90_s": percentile(follow, 90),
        "first_ttft_median_s": statistics.median(first),
        "first_ttft_max_s": max(first),
        "prefill_tokens": sum(s[2] for s in steps),
        "decode_rows": sum(s[1] for s in steps),
        "seconds_by_decode_width": dict(sorted(by_width.items())),
        "steps": steps,
        "turns": turns,
    }


def markdown(runs: list[dict[str, Any]], prefill_rate: float, decode_rate: float, machine: dict[str, Any]) -> str:
    lines = [
        f"Machine: {machine}.",
        f"Primitives (this run): prefill {prefill_rate:.0f} tok/s, decode {decode_rate:.1f} tok/s at 8 sequences.",
        "",
        "| run | variant | wall (s) | in llama_decode (s) | roofline (s) | of roofline "
        "| follow-up TTFT median / p90 (s) | of which queued (median) "
        "| first-turn TTFT median / max (s) | of which queued (median) "
        "| step seconds by decoding rows (0 / 1-3 / 4-7 / 8+) |",
        "|---|---|---:|---:|---:|---:|---|---:|---|---:|---|",
    ]
    for k, r in enumerate(runs, 1):
        roof = r["prefill_tokens"] / prefill_rate + r["decode_rows"] / decode_rate
        w = r["seconds_by_decode_width"]
        bands = [
            sum(v for d, v in w.items() if d == 0),
            sum(v for d, v in w.items() if 1 <= d <= 3),
            sum(v for d, v in w.items() if 4 <= d <= 7),
            sum(v for d, v in w.items() if d >= 8),
        ]
        name = ", ".join(f"{key} {value}" for key, value in r["variant"].items()) or "default"
        lines.append(
            f"| {k} | {name} | {r['wall_s']:.1f} | {r['decode_busy_s']:.1f} | {roof:.1f} "
            f"| {100 * roof / r['wall_s']:.0f}% "
            f"| {r['followup_ttft_median_s']:.2f} / {r['followup_ttft_p90_s']:.2f} "
            f"| {r['followup_queued_median_s']:.2f} "
            f"| {r['first_ttft_median_s']:.1f} / {r['first_ttft_max_s']:.1f} | {r['first_queued_median_s']:.1f} "
            f"| {' / '.join(f'{b:.1f}' for b in bands)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        default="",
        help="engine variants to run, alternating: ';'-separated, each a ','-separated list of KEY=VALUE "
        "(JSON values), e.g. 'batch_invariant=true;batch_invariant=false,hot_sessions=16' (default: the defaults)",
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="peer.py's preset (default: 8x4)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant (default 2)")
    p.add_argument("--name", default="replay", help="results file name (default replay)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    model = embedded_model_path(progress=False)
    spec = WorkloadSpec(**WORKLOADS[args.workload]) if args.workload else WorkloadSpec()
    variants = [engine_overrides(v.split(",")) if v.strip() else {} for v in args.variants.split(";")]
    runs = []
    for _ in range(args.rounds):
        for variant in variants:
            runs.append(replay(model, variant, spec, args.threads))
            r = runs[-1]
            print(
                f"{variant or 'default'}: wall {r['wall_s']:.1f} s ({r['decode_busy_s']:.1f} s in llama_decode), "
                f"TTFT median first {r['first_ttft_median_s']:.2f} s / follow-up {r['followup_ttft_median_s']:.2f} s",
                flush=True,
            )
    prefill_rate = primitive_prefill_isolated(args.threads)
    decode_rate = primitive_isolated(spec.sample_len, args.threads, 8)
    report = markdown(runs, prefill_rate, decode_rate, machine_facts())
    print("\n" + report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(report)
    (args.out / f"{args.name}.json").write_text(json.dumps({"runs": runs, "prefill_tok_s": prefill_rate}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
