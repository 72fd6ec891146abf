#!/usr/bin/env python3
"""OpenAI-compatible HTTP API vs gRPC on one live server (2 replicas of the bundled Gemma).

1. **Cached share of a stateless 4-turn chat.** C conversations, each sent as a whole history
   every turn through ``/v1/chat/completions`` (``openai`` package, no session header), and the
   same conversations through the gRPC SDK (one session each) as the baseline: per follow-up
   turn, ``cached_tokens`` / the previous turn's prompt and / its own prompt.
2. **Transport overhead per token.** The same greedy reply (same prompt, same length) streamed
   over gRPC, over HTTP server-sent events, and returned whole over HTTP, alternating, R times:
   the client's wall time minus the server's own time for the request (queue + prefill +
   decode, which each API reports), divided by the completion tokens.
3. **Structured output and logprobs in the engine.** Server-side decode time per token of the
   same prompt with no constraint, a JSON Schema, and logprobs with top_logprobs=5.

Run: ``.venv/bin/python bench/openai_http.py [--conversations 4] [--reps 5] [--tokens 64]``;
writes ``bench/results/openai_http.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "gemma-3-270m"
TOKEN = "bench-" + secrets.token_urlsafe(16)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


def start(threads: int) -> tuple[str, str]:
    from conftest import free_port

    from hotloop_serve.config import config_from_dict
    from hotloop_serve.serve.runner import start_server, wait_until_serving

    grpc_port, http_port = free_port(), free_port()
    engine = {"context_tokens": 8192, "session_context_tokens": 4096, "hot_sessions": 4, "threads": threads}
    config = config_from_dict(
        {
            "server": {"grpc_port": grpc_port, "http_port": http_port},
            "auth": {"tokens": {"bench": TOKEN}},
            "telemetry": {"enabled": False},
            "models": [{"name": MODEL, "replicas": 2, "engine": engine, "resources": {"num_cpus": 1}}],
        }
    )
    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    start_server(config, num_cpus=4)
    wait_until_serving(f"127.0.0.1:{grpc_port}", [MODEL], timeout_s=300)
    return f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/{MODEL}/v1"


def opening(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"You are assistant number {i}. Answer in one or two short sentences."},
        {"role": "user", "content": f"Tell me a fact about the number {i * 7 + 3}."},
    ]


def chat_http(oa: Any, conversations: int, turns: int) -> list[tuple[int, int, int]]:
    """(turn, prompt_tokens, cached_tokens) of every request."""
    out = []
    for c in range(conversations):
        messages = opening(c)
        for t in range(turns):
            reply = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
            u = reply.usage
            out.append((t, u.prompt_tokens, u.prompt_tokens_details.cached_tokens))
            messages = [*messages, {"role": "assistant", "content": reply.choices[0].message.content}]
            messages.append({"role": "user", "content": f"Interesting. Another one, please ({t + 2})?"})
    return out


def chat_grpc(client: Any, conversations: int, turns: int) -> list[tuple[int, int, int]]:
    from hotloop_client import Message, Role, Settings

    out = []
    for c in range(conversations):
        session = client.model(MODEL).new_session(settings=Settings(temperature=0, sample_len=32))
        history = [Message(Role(m["role"]), m["content"]) for m in opening(c)]
        for t in range(turns):
            chunks = list(session.generate(history))
            u = chunks[-1].usage
            out.append((t, u.prompt_tokens, u.cached_tokens + u.restored_tokens))
            history = [*history, Message(Role.ASSISTANT, "".join(ch.text for ch in chunks))]
            history.append(Message(Role.USER, f"Interesting. Another one, please ({t + 2})?"))
        session.close()
    return out


def shares(rows: list[tuple[int, int, int]]) -> dict[str, float]:
    prior = {}
    of_prior, of_own = [], []
    for i, (turn, prompt, cached) in enumerate(rows):
        if turn > 0:
            of_prior.append(cached / prior[i - 1])
            of_own.append(cached / prompt)
        prior[i] = prompt
    return {
        "followups": len(of_prior),
        "cached_of_prior_prompt_min": min(of_prior),
        "cached_of_prior_prompt_mean": statistics.mean(of_prior),
        "cached_of_own_prompt_mean": statistics.mean(of_own),
    }


def server_ms(t: dict[str, float]) -> float:
    return t["queue_ms"] + t["prefill_ms"] + t["decode_ms"]


def overhead(grpc_address: str, base_url: str, reps: int, tokens: int) -> dict[str, Any]:
    import openai
    from hotloop_client import Client, Message, Role, Settings

    ask = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
    rows: dict[str, list[tuple[float, float, int]]] = {"grpc": [], "http_sse": [], "http_json": []}
    with Client(grpc_address, token=TOKEN) as client, openai.OpenAI(base_url=base_url, api_key=TOKEN) as oa:
        session = client.model(MODEL).new_session(settings=Settings(temperature=0, sample_len=tokens))
        history = [Message(Role.USER, ask[0]["content"])]
        for _ in range(reps + 1):  # the first round warms every path up and is dropped
            t0 = time.perf_counter()
            chunks = list(session.generate(history))
            wall = (time.perf_counter() - t0) * 1e3
            last = chunks[-1]
            t = last.timings
            rows["grpc"].append((wall, t.queue_ms + t.prefill_ms + t.decode_ms, last.usage.completion_tokens))

            t0 = time.perf_counter()
            stream = oa.chat.completions.create(
                model=MODEL,
                messages=ask,
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            events = list(stream)
            wall = (time.perf_counter() - t0) * 1e3
            final = next(e for e in events if e.choices and e.choices[0].finish_reason)
            ext = final.model_extra["hotloop"]
            rows["http_sse"].append((wall, server_ms(ext["timings"]), events[-1].usage.completion_tokens))

            t0 = time.perf_counter()
            whole = oa.chat.completions.create(model=MODEL, messages=ask, max_tokens=tokens, temperature=0)
            wall = (time.perf_counter() - t0) * 1e3
            ext = whole.model_extra["hotloop"]
            rows["http_json"].append((wall, server_ms(ext["timings"]), whole.usage.completion_tokens))
        session.close()
    out = {}
    for name, samples in rows.items():
        kept = samples[1:]
        per_token = [(wall - srv) / n for wall, srv, n in kept]
        out[name] = {
            "completion_tokens": kept[0][2],
            "wall_ms_median": statistics.median(w for w, _, _ in kept),
            "server_ms_median": statistics.median(s for _, s, _ in kept),
            "overhead_ms_per_token_median": statistics.median(per_token),
            "overhead_ms_per_request_median": statistics.median(w - s for w, s, _ in kept),
        }
    return out


def constrained(grpc_address: str, reps: int) -> dict[str, Any]:
    from hotloop_client import Client, Message, Role, Settings

    cases = {
        "none": Settings(temperature=0, sample_len=48),
        "json_schema": Settings(temperature=0, sample_len=48, json_schema=json.dumps(PERSON)),
        "logprobs_top5": Settings(temperature=0, sample_len=48, logprobs=True, top_logprobs=5),
    }
    history = [Message(Role.USER, "Describe a person named Ann, aged 31, from Oslo, as JSON.")]
    out = {}
    with Client(grpc_address, token=TOKEN) as client:
        for name, settings in cases.items():
            per_token = []
            for _ in range(reps):
                session = client.model(MODEL).new_session(settings=settings)
                last = list(session.generate(history))[-1]
                n = last.usage.completion_tokens
                if n > 1:
                    per_token.append(last.timings.decode_ms / (n - 1))
                session.close()
            out[name] = {"decode_ms_per_token_median": statistics.median(per_token), "completion_tokens": n}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import openai
    from hotloop_client import Client

    from hotloop_serve.serve.runner import stop_server

    grpc_address, base_url = start(args.threads)
    try:
        with openai.OpenAI(base_url=base_url, api_key=TOKEN) as oa:
            http_rows = chat_http(oa, args.conversations, args.turns)
        with Client(grpc_address, token=TOKEN) as client:
            grpc_rows = chat_grpc(client, args.conversations, args.turns)
        result = {
            "cached_share": {"http_stateless": shares(http_rows), "grpc_sessions": shares(grpc_rows)},
            "http_rows": http_rows,
            "grpc_rows": grpc_rows,
            "overhead": overhead(grpc_address, base_url, args.reps, args.tokens),
            "engine": constrained(grpc_address, max(2, args.reps // 2)),
        }
    finally:
        stop_server()

    lines = ["# OpenAI HTTP vs gRPC (2 replicas of Gemma 3 270M)", ""]
    lines += ["| 4-turn chat | follow-ups | cached / prior prompt (min) | (mean) | cached / own prompt (mean) |"]
    lines += ["|---|---|---|---|---|"]
    for name, s in result["cached_share"].items():
        lines.append(
            f"| {name} | {s['followups']} | {s['cached_of_prior_prompt_min']:.1%} | "
            f"{s['cached_of_prior_prompt_mean']:.1%} | {s['cached_of_own_prompt_mean']:.1%} |"
        )
    lines += ["", "| transport | tokens | wall ms (median) | server ms | overhead ms/request | overhead ms/token |"]
    lines += ["|---|---|---|---|---|---|"]
    for name, o in result["overhead"].items():
        lines.append(
            f"| {name} | {o['completion_tokens']} | {o['wall_ms_median']:.1f} | {o['server_ms_median']:.1f} | "
            f"{o['overhead_ms_per_request_median']:.1f} | {o['overhead_ms_per_token_median']:.2f} |"
        )
    lines += ["", "| sampling | decode ms/token (median) | tokens |", "|---|---|---|"]
    for name, e in result["engine"].items():
        lines.append(f"| {name} | {e['decode_ms_per_token_median']:.1f} | {e['completion_tokens']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "openai_http.md").write_text(text)
    (RESULTS / "openai_http.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
