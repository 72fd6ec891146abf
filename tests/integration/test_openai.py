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

import jsonschema
import openai
import pytest
from hotloop_client import Client, InvalidArgument, Message, Role, Settings

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


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_leaving_cancels_its_turn(http: Http, stream: bool) -> None:
    from ray import serve

    ask = [{"role": "user", "content": "Write a very long essay about rivers."}]
    # A grammar that cannot end before 1500 characters: the turn runs until cancelled.
    long_turn = {"grammar": "root ::= [a-z ]{1500,1600}"}
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
    with pytest.raises(openai.BadRequestError) as n2:
        alice.chat.completions.create(model=MODEL, messages=ask, n=2)  # type: ignore[arg-type]
    assert n2.value.param == "n"


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
