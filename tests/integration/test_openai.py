"""The OpenAI-compatible HTTP API against a live server, with the real ``openai`` package.

Its own server: two replicas of the bundled Gemma (so a stateless client's follow-ups must be
routed to the replica holding their prefix), auth on with two principals, a small body limit.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest
from hotloop_client import Client, FinishReason, InvalidArgument, Message, Role, Settings, Tool, assistant_message

from hotloop_serve.config import Config, config_from_dict

from .conftest import Server, wait_until_every_replica_serves

pytestmark = pytest.mark.integration

MODEL = "gemma-openai"
OTHER = "gemma-other"
ALICE = "alice-" + secrets.token_urlsafe(16)
BOB = "bob-" + secrets.token_urlsafe(16)
MAX_BODY = 64 * 1024
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass
class Http:
    base_url: str
    grpc: str
    config: Config


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[Http]:
    """Two applications of their own (auth on) on the shared server: its gRPC and HTTP proxies."""
    from ray import serve

    from hotloop_serve.serve.app import model_app, session_secret
    from hotloop_serve.serve.probe import wait_until_serving

    engine = {"context_tokens": 8192, "session_context_tokens": 4096, "hot_sessions": 4, "threads": 1}
    doc = server.config.model_dump(mode="json")
    doc["auth"] = {"tokens": {"alice": ALICE, "bob": BOB}}
    doc["models"] = [
        {
            "name": MODEL,
            "replicas": 2,
            "engine": engine,
            "resources": {"num_cpus": 0.5},
            "limits": {"max_request_bytes": MAX_BODY},
        },
        {"name": OTHER, "engine": engine, "resources": {"num_cpus": 0.5}},
    ]
    config = config_from_dict(doc)
    secret = session_secret(config)
    try:
        for m in config.models:
            serve.run(model_app(config, m, secret), name=m.name, route_prefix=f"/{m.name}")
        wait_until_serving(server.address, [MODEL, OTHER], timeout_s=300)
        wait_until_every_replica_serves(server.address, MODEL, replicas=2, timeout_s=180, token=ALICE)
        http_port = config.server.http_port
        yield Http(f"http://127.0.0.1:{http_port}/{MODEL}/v1", server.address, config)
    finally:
        for name in (MODEL, OTHER):
            if serve.status().applications.get(name) is not None:
                serve.delete(name)


@pytest.fixture
def alice(http: Http) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=http.base_url, api_key=ALICE, max_retries=0, timeout=120) as client:
        yield client


def test_models_lists_the_served_models_and_one_base_url_serves_them_all(alice: openai.OpenAI) -> None:
    assert [m.id for m in alice.models.list()] == [MODEL, OTHER]
    assert alice.models.retrieve(OTHER).id == OTHER
    ask = [{"role": "user", "content": "Hello there."}]
    first = alice.chat.completions.create(model=OTHER, messages=ask, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    again = alice.chat.completions.create(model=OTHER, messages=ask, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert first.model == OTHER and first.model_extra is not None
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # routed, hot


def test_a_reply_with_usage_finish_reason_and_a_seed(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Write one sentence about the sea."}]
    first = alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, seed=7, temperature=0.9)
    again = alice.chat.completions.create(model=MODEL, messages=ask, max_completion_tokens=12, seed=7, temperature=0.9)
    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert first.usage is not None and first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.prompt_tokens_details is not None
    assert again.choices[0].message.content == choice.message.content  # same seed, same reply
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_streaming_deltas_a_stop_sequence_and_usage(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    whole = alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0)
    text = whole.choices[0].message.content or ""
    chunks = list(
        alice.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    if len(text) > 6:  # a stop sequence taken from the reply itself ends it there
        stop = text[3:6]
        cut = alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].message.content == text[: text.index(stop)]


def _four_turns(client: openai.OpenAI, headers: dict[str, str] | None = None) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of 4 turns of one conversation, sent statelessly."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a helpful assistant who answers briefly."},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    seen = []
    for turn in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            extra_headers=headers,  # type: ignore[arg-type]
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        seen.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        messages.append({"role": "user", "content": f"And now something else, number {turn + 2}?"})
    return seen


@pytest.mark.parametrize("headers", [None, {"X-Session-Id": "conversation-42"}], ids=["opening", "header"])
def test_a_stateless_four_turn_chat_stays_hot(alice: openai.OpenAI, headers: dict[str, str] | None) -> None:
    """Turns 2-4 reuse >= 90% of the prior prompt, with two replicas: routed to the prefix's owner."""
    turns = _four_turns(alice, headers)
    for (prior, _), (_, cached) in itertools.pairwise(turns):
        assert cached >= 0.9 * prior, turns


def test_principals_never_share_a_conversation(http: Http, alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "A private question about principals and isolation."}]
    alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    with openai.OpenAI(base_url=http.base_url, api_key=BOB, max_retries=0) as bob:
        reply = bob.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # nothing of alice's cache


def test_two_requests_of_one_conversation_at_once_both_complete(alice: openai.OpenAI) -> None:
    """The second gets an alternate session of the conversation instead of superseding the first."""
    ask = [{"role": "user", "content": "Tell me a story about two identical requests."}]
    with ThreadPoolExecutor(2) as pool:
        replies = list(
            pool.map(
                lambda _: alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=24, temperature=0),  # type: ignore[arg-type]
                range(2),
            )
        )
    assert [r.choices[0].finish_reason for r in replies] == ["length", "length"]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_n_choices_whole_and_streamed_share_the_prompt(alice: openai.OpenAI) -> None:
    """n choices of one prompt: indices 0..n-1, usage counts the prompt once and sums the
    completions; sampled choices (distinct seeds) usually differ, greedy ones are identical;
    streamed, each chunk names its choice."""
    ask = [{"role": "user", "content": "Name a colour and say why you like it."}]
    sampled = alice.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=10, temperature=1.0, seed=11)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason in ("stop", "length") for c in sampled.choices)
    assert sampled.usage is not None and 3 <= sampled.usage.completion_tokens <= 30
    assert sampled.usage.total_tokens == sampled.usage.prompt_tokens + sampled.usage.completion_tokens
    greedy = alice.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=10, temperature=0)
    texts = [c.message.content for c in greedy.choices]
    assert texts[0] and texts == [texts[0]] * 3
    one = alice.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0)
    assert greedy.usage is not None and one.usage is not None
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens_details is not None  # the prompt was hot from the sampled turn
    assert greedy.usage.prompt_tokens_details.cached_tokens >= greedy.usage.prompt_tokens - 8
    chunks = list(
        alice.chat.completions.create(
            model=MODEL,
            messages=ask,
            n=3,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert streamed == dict(enumerate(texts)) and set(finished) == {0, 1, 2}
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens


def test_n_choices_under_concurrent_requests_all_complete(alice: openai.OpenAI) -> None:
    """Several n > 1 turns at once, of different conversations (so both replicas, and turns handed
    to another replica): every one completes with all its choices (the fan-out that stalled)."""

    def turn(i: int) -> list[int]:
        ask = [{"role": "user", "content": f"Write a short line about the number {i}."}]
        if i % 2:
            reply = alice.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=8, temperature=0.8)  # type: ignore[arg-type]
            return sorted(c.index for c in reply.choices if c.finish_reason)
        chunks = alice.chat.completions.create(model=MODEL, messages=ask, n=3, max_tokens=8, stream=True)  # type: ignore[arg-type]
        return sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(turn, range(8)))
    assert done == [[0, 1, 2]] * 8
    assert time.monotonic() - t0 < 110


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_leaving_cancels_its_turn(http: Http, stream: bool) -> None:
    from ray import serve

    ask = [{"role": "user", "content": "Write a very long essay about rivers."}]
    # A grammar that cannot end before 1500 characters: the turn runs until cancelled.
    long_turn = {"grammar": "root ::= [a-z ]{1000} [a-z ]{500,600}"}  # a long reply; repetitions stay under the bound
    with openai.OpenAI(base_url=http.base_url, api_key=ALICE, max_retries=0, timeout=3) as client:
        if stream:
            events = client.chat.completions.create(
                model=MODEL,
                messages=ask,
                max_tokens=2000,
                stream=True,
                extra_body=long_turn,  # type: ignore[arg-type]
            )
            for i, _ in enumerate(events):
                if i == 3:
                    break
            events.close()
        else:
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2000, extra_body=long_turn)  # type: ignore[arg-type]
    handle = serve.get_deployment_handle(MODEL, MODEL)
    deadline = time.monotonic() + 20
    idle = 0
    while idle < 8:  # eight answers in a row, from both replicas, with nothing running
        assert time.monotonic() < deadline, "the turn kept running after its client left"
        idle = idle + 1 if handle.stats.remote().result()["active_requests"] == 0 else 0
        time.sleep(0.1)


def test_a_json_schema_reply_parses_and_validates(alice: openai.OpenAI) -> None:
    reply = alice.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON."}],
        max_tokens=64,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)
    anything = alice.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Some JSON please."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)


def test_logprobs_are_consistent_with_the_text(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Say hello to the world."}]
    reply = alice.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    tokens = choice.logprobs.content
    assert bytes(b for t in tokens for b in (t.bytes or [])).decode() == choice.message.content
    assert len(tokens) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for t in tokens:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the most likely
    streamed = alice.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=16, temperature=0, logprobs=True, stream=True
    )
    pieces = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [t.token for t in pieces] == [t.token for t in tokens]
    assert no_logprobs_unless_asked(alice)


def no_logprobs_unless_asked(alice: openai.OpenAI) -> bool:
    reply = alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    return reply.choices[0].logprobs is None


def test_bad_requests_get_their_status_and_an_openai_error_body(http: Http, alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as nf:
        alice.chat.completions.create(model="no-such-model", messages=ask)  # type: ignore[arg-type]
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        alice.chat.completions.create(
            model=MODEL,
            messages=ask,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert bad.value.status_code == 400 and bad.value.type == "invalid_request_error"
    assert "json_schema" in bad.value.message and "nonsense" in bad.value.message
    with pytest.raises(openai.BadRequestError) as grammar:
        alice.chat.completions.create(model=MODEL, messages=ask, extra_body={"grammar": 'root ::= "a'})  # type: ignore[arg-type]
    assert "grammar is not valid GBNF" in grammar.value.message
    with pytest.raises(openai.APIStatusError) as big:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])
    assert big.value.status_code == 413 and big.value.code == "request_too_large"
    stranger = openai.OpenAI(base_url=http.base_url, api_key="not-a-token-of-ours", max_retries=0)
    with stranger, pytest.raises(openai.AuthenticationError) as wrong:
        stranger.chat.completions.create(model=MODEL, messages=ask)  # type: ignore[arg-type]
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    status, body = _post(f"{http.base_url}/chat/completions", {"model": MODEL, "messages": ask})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key" and "bearer" in body["error"]["message"]
    assert _post(f"{http.base_url}/models", None)[0] == 401
    with pytest.raises(openai.BadRequestError) as n9:
        alice.chat.completions.create(model=MODEL, messages=ask, n=9)  # type: ignore[arg-type]
    assert n9.value.param == "n" and "between 1 and 8" in n9.value.message


def _post(url: str, payload: object) -> tuple[int, dict[str, object]]:
    """A request with no Authorization header (GET when ``payload`` is None): (status, JSON body)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_structured_output_and_logprobs_over_grpc(http: Http) -> None:
    settings = Settings(temperature=0, sample_len=64, json_schema=json.dumps(PERSON), logprobs=True, top_logprobs=2)
    with Client(http.grpc, token=ALICE) as client:
        session = client.model(MODEL).new_session(settings=settings)
        chunks = list(session.generate([Message(Role.USER, "Describe a person named Ann, aged 31, as JSON.")]))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), PERSON)
    pieces = b"".join(lp.piece for c in chunks for lp in c.logprobs)
    assert pieces.decode() == text
    assert all(len(lp.top) == 2 for c in chunks for lp in c.logprobs)
    with Client(http.grpc, token=ALICE) as client:
        session = client.model(MODEL).new_session()
        with pytest.raises(InvalidArgument, match="json_schema is not supported"):
            list(session.generate([Message(Role.USER, "x")], json_schema='{"type": "nonsense"}'))
        with pytest.raises(InvalidArgument, match="grammar is not valid GBNF"):
            client.model(MODEL).new_session(settings=Settings(grammar='root ::= "a'))


# ------------------------------------------------------------------------------- tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["Europe/Paris", "Europe/Oslo", "UTC"]}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def _force(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _valid_call(call: Any, tools: list[dict[str, Any]] = TOOLS) -> dict[str, Any]:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments  # type: ignore[no-any-return]


def test_a_tool_loop_with_forced_calls_parses_validates_and_stays_hot(alice: openai.OpenAI) -> None:
    """Two tool rounds then an answer, the way an agent loop sends them: every call parses and
    matches its schema, and each follow-up reuses the cache of the previous turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris, and what time is it there?"},
    ]
    seen: list[tuple[int, int]] = []
    for name, result in [("get_weather", "Sunny, 21 C."), ("get_time", "14:05")]:
        reply = alice.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=_force(name),
            parallel_tool_calls=False,  # the base model, once forced, would repeat the call up to 8 times
            max_tokens=64,
            temperature=0,  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1 and {c.function.name for c in calls} == {name}  # type: ignore[union-attr]
        for c in calls:
            _valid_call(c)
            assert c.id.startswith("call_") and c.type == "function"
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        seen.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages.append(choice.message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": result} for c in calls]
    final = alice.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
    assert final.usage is not None and final.usage.prompt_tokens_details is not None
    seen.append((final.usage.prompt_tokens, final.usage.prompt_tokens_details.cached_tokens or 0))
    for (prior, _), (_, cached) in itertools.pairwise(seen):
        assert cached >= 0.9 * prior, seen


def test_streamed_tool_calls_arrive_as_openai_sends_them(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What time is it in Oslo?"}]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": TOOLS, "tool_choice": "required"}
    kwargs["parallel_tool_calls"] = False
    whole = alice.chat.completions.create(**kwargs, max_tokens=96, temperature=0)
    chunks = list(alice.chat.completions.create(**kwargs, max_tokens=96, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id is not None and deltas[0].function is not None and deltas[0].function.name
    assert all(d.id is None for d in deltas if d.function is not None and not d.function.name)
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
        entry["name"] += (d.function.name or "") if d.function else ""
        entry["arguments"] += (d.function.arguments or "") if d.function else ""
    expected = whole.choices[0].message.tool_calls or []
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments)
        for c in expected  # type: ignore[union-attr]
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_auto_lets_the_model_answer_in_text_or_call_and_parallel_off_means_one_call(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Hello! How are you today?"}]
    for seed in range(3):
        reply = alice.chat.completions.create(
            model=MODEL,
            messages=ask,
            tools=TOOLS,
            max_tokens=48,
            temperature=1.0,
            seed=seed,  # type: ignore[arg-type]
        )
        message = reply.choices[0].message
        assert "```tool_call" not in (message.content or "")  # the syntax never leaks into text
        if reply.choices[0].finish_reason == "tool_calls":  # (a call cut by max_tokens ends with "length")
            for call in message.tool_calls or []:
                _valid_call(call)
    one = alice.chat.completions.create(
        model=MODEL,
        messages=ask,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=1.0,
        seed=1,
    )
    assert len(one.choices[0].message.tool_calls or []) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s_naming_the_field(alice: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Hi"}]
    nonsense = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}},
    }
    orphan = [*ask, {"role": "tool", "tool_call_id": "call_nobody", "content": "x"}]
    for kwargs, param in [
        ({"tools": TOOLS, "tool_choice": _force("launch_rockets")}, "tool_choice"),
        ({"tools": [nonsense]}, "tools.0.function.parameters"),
        ({"messages": orphan}, "messages.1.tool_call_id"),
        ({"tools": TOOLS, "extra_body": {"grammar": 'root ::= "x"'}}, "grammar"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            alice.chat.completions.create(**{"model": MODEL, "messages": ask, **kwargs})
        assert bad.value.param == param, bad.value.message


# ------------------------------------------------------------------------------- responses


def test_responses_with_previous_response_id_run_a_tool_loop_on_a_hot_session(http: Http, alice: openai.OpenAI) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    first = alice.responses.create(
        model=MODEL,
        instructions="You are a travel assistant. Use the tools.",
        input="What is the weather in Paris?",
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), TOOLS[0]["function"]["parameters"])  # type: ignore[index]
    second = alice.responses.create(
        model=MODEL,
        instructions="You are a travel assistant. Use the tools.",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C."} for c in calls],
        tools=tools,  # type: ignore[arg-type]
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
    assert second.output[0].type == "message"
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * first.usage.input_tokens  # no history resent
    # instructions and tools are not carried over (as OpenAI's): an agent resends them every turn
    same = {"instructions": "You are a travel assistant. Use the tools.", "tools": tools, "tool_choice": "none"}
    third = alice.responses.create(
        model=MODEL,
        previous_response_id=second.id,
        input="Thanks! And Oslo?",
        max_output_tokens=8,
        temperature=0,
        **same,
    )
    assert third.usage is not None and third.usage.input_tokens_details.cached_tokens >= 0.9 * second.usage.input_tokens
    # continuing an older response forks: both branches are hot, the old one from its own history
    branch = alice.responses.create(
        model=MODEL, previous_response_id=second.id, input="And Rome?", max_output_tokens=8, temperature=0, **same
    )
    assert branch.usage is not None
    assert branch.usage.input_tokens_details.cached_tokens >= 0.9 * second.usage.input_tokens
    assert branch.usage.input_tokens < third.usage.input_tokens + 4  # not third's history
    got = alice.responses.retrieve(second.id)
    assert got.id == second.id and got.output[0].type == "message"
    items = alice.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["function_call_output"] * len(calls)
    with openai.OpenAI(base_url=http.base_url, api_key=BOB, max_retries=0) as bob:
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError) as other:
            bob.responses.create(model=MODEL, previous_response_id=second.id, input="hi", max_output_tokens=4)
        assert "not found" in other.value.message
    alice.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve("resp_" + "x" * 46)


def test_streamed_responses_send_the_typed_events_and_store_false_keeps_nothing(alice: openai.OpenAI) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    events = list(
        alice.responses.create(
            model=MODEL,
            input="What time is it in Oslo?",
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=64,
            temperature=0,
            stream=True,
            store=False,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response  # type: ignore[union-attr]
    call = next(o for o in done.output if o.type == "function_call")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert call.arguments == args and json.loads(args)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(done.id)
    text = alice.responses.create(
        model=MODEL,
        input="Describe a person named Ann, aged 31, as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        max_output_tokens=64,
        temperature=0.7,
        store=False,
    )
    jsonschema.validate(json.loads(text.output_text), PERSON)


def test_a_tool_loop_over_grpc_with_the_python_sdk(http: Http) -> None:
    """The same concepts over gRPC: tools per turn, calls as chunk deltas, results as tool messages."""
    tools = [Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    history = [Message(Role.USER, "What is the weather in Paris?")]
    with Client(http.grpc, token=ALICE) as client:
        session = client.model(MODEL).new_session(settings=Settings(temperature=0, sample_len=64))
        chunks = list(session.generate(history, tools=tools, tool_choice="get_weather", parallel_tool_calls=False))
        reply = assistant_message(chunks)
        assert chunks[-1].finish_reason is FinishReason.TOOL_CALLS and reply.content == ""
        (call,) = reply.tool_calls
        assert call.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
        history += [reply, Message(Role.TOOL, "Sunny, 21 C.", tool_call_id=call.id)]
        final = list(session.generate(history, tools=tools, tool_choice="none", sample_len=8))
        assert final[-1].usage is not None and final[-1].usage.cached_tokens >= chunks[-1].usage.prompt_tokens  # type: ignore[union-attr]
        assert not any(c.tool_calls for c in final)
        with pytest.raises(InvalidArgument, match="no tool named"):
            list(session.generate(history, tools=tools, tool_choice="launch_rockets"))
        with pytest.raises(InvalidArgument, match="matches no tool call"):
            list(session.generate([Message(Role.TOOL, "x", tool_call_id="nobody")]))
