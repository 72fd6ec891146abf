"""The synthetic engine (``engine.kind: synthetic``) served through the real stack: Ray Serve's
gRPC proxy, the replica's servicer, the SDK; and the OpenAI HTTP path.

Its own application on the shared server, many streams at once: every stream gets exactly its
``sample_len`` tokens, in several chunks, from the engine's fixed vocabulary.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hotloop_client import Client, Message, Role, Settings

from .conftest import Server, synthetic_app

pytestmark = pytest.mark.integration
APP = "synthetic-load"
STREAMS = 24
TOKENS = 40


@pytest.fixture(scope="module")
def synthetic_load(server: Server) -> Iterator[Server]:
    engine = {"synthetic_step_ms": 10, "hot_sessions": 32, "context_tokens": 32768, "session_context_tokens": 1024}
    with synthetic_app(server, APP, engine, {"resources": {"num_cpus": 0.5}}) as app:
        yield app


def test_many_streams_get_every_token(synthetic_load: Server) -> None:
    def one(i: int) -> tuple[int, int, str]:
        settings = Settings(temperature=0, sample_len=TOKENS)
        with Client(synthetic_load.address) as c, c.model(APP).new_session(settings=settings) as s:
            chunks = list(s.generate([Message(Role.USER, f"stream {i}")]))
        final = chunks[-1]
        assert final.usage is not None and final.finish_reason is not None
        return final.usage.completion_tokens, len(chunks), "".join(c.text for c in chunks)

    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(one, range(STREAMS)))
    assert all(tokens == TOKENS for tokens, _, _ in results)
    assert all(chunks > 1 for _, chunks, _ in results), "replies stream in several chunks"
    assert all("lorem ipsum" in text for _, _, text in results)


def test_openai_http_streams_the_synthetic_reply(synthetic_load: Server) -> None:
    body = {
        "model": APP,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    port = synthetic_load.config.server.http_port
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/{APP}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    deltas, usage = [], None
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                deltas.append(event["choices"][0]["delta"]["content"])
    assert usage is not None and usage["completion_tokens"] == TOKENS
    assert len(deltas) > 1 and "lorem" in "".join(deltas)
