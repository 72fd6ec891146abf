"""Stored responses outlive their replica when the model has a ``persist_dir``.

Its own application on the shared server (one replica, auth off): a stored response is created,
the application is deleted and deployed again (a new replica, nothing in memory), and the
response is still there: retrievable, continuable with ``previous_response_id``, deletable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hotloop_serve.config import config_from_dict

from .conftest import Server

pytestmark = pytest.mark.integration

MODEL = "gemma-persist"


def _deploy(server: Server, persist_dir: Path) -> None:
    from ray import serve

    from hotloop_serve.serve.app import model_app, session_secret
    from hotloop_serve.serve.probe import wait_until_serving

    doc = server.config.model_dump(mode="json")
    engine = {"context_tokens": 4096, "session_context_tokens": 2048, "hot_sessions": 2, "threads": 1}
    engine["persist_dir"] = str(persist_dir)
    doc["models"] = [{"name": MODEL, "engine": engine, "resources": {"num_cpus": 0.5}}]
    config = config_from_dict(doc)
    serve.run(model_app(config, config.models[0], session_secret(config)), name=MODEL, route_prefix=f"/{MODEL}")
    wait_until_serving(server.address, [MODEL], timeout_s=300)


@pytest.fixture(scope="module")
def persisted(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    from ray import serve

    persist_dir = tmp_path_factory.mktemp("persist")
    try:
        _deploy(server, persist_dir)
        yield server, persist_dir
    finally:
        if serve.status().applications.get(MODEL) is not None:
            serve.delete(MODEL)


def test_a_stored_response_survives_a_new_replica(persisted: tuple[Server, Path]) -> None:
    from ray import serve

    server, persist_dir = persisted
    base_url = f"http://127.0.0.1:{server.config.server.http_port}/{MODEL}/v1"
    with openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=120) as client:
        first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6, temperature=0)
        assert list((persist_dir / "responses").iterdir())
        serve.delete(MODEL)  # the replica and everything in its memory go
        _deploy(server, persist_dir)
        got = client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        second = client.responses.create(
            model=MODEL, previous_response_id=first.id, input="Another one?", max_output_tokens=6, temperature=0
        )
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens  # the stored conversation came back
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
