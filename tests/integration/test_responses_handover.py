"""Stored responses follow their conversation when the fleet changes (no ``persist_dir``).

As ``test_fleet.py``: ``serve.run`` of a changed application replaces its two replicas one after
the other. Each leaving replica pushes its stored responses, with the sessions they use, to
their keys' next owners (``responses_handover``); without that the records, held in memory
only, would be gone. Afterwards every response is retrievable by its id, and continuing it with
``previous_response_id`` finds its conversation cached on the new owner.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from ray import serve

from hotloop_serve.config import config_from_dict
from hotloop_serve.serve.app import model_app

from .conftest import Server, wait_until_every_replica_serves

pytestmark = pytest.mark.integration
APP = "gemma-responses-fleet"
SECRET = "responses-fleet-secret-0123456789ab"


def deploy(server: Server, generation: int) -> None:
    doc = server.config.model_dump(mode="json")
    doc["models"] = [
        {
            "name": APP,
            "replicas": 2,
            "engine": {"context_tokens": 8192, "session_context_tokens": 2048, "hot_sessions": 8, "threads": 1,
                       "seed": generation},  # a changed option: Ray replaces every replica
            "resources": {"num_cpus": 0.5},
            "graceful_shutdown_timeout_s": 30,
        }
    ]  # fmt: skip
    config = config_from_dict(doc)
    serve.run(model_app(config, config.models[0], SECRET), name=APP, route_prefix=f"/{APP}")


@pytest.fixture
def fleet(server: Server) -> Iterator[Server]:
    yield server
    if serve.status().applications.get(APP) is not None:
        serve.delete(APP)


def notes(i: int) -> str:
    items = " ".join(f"Item {j} of list {i} is a {['cat', 'boat', 'tree'][j % 3]}." for j in range(30))
    return f"Remember list {i}: {items}"


def test_stored_responses_and_their_sessions_survive_a_rolling_replacement(fleet: Server) -> None:
    t0 = time.monotonic()
    deploy(fleet, 1)
    wait_until_every_replica_serves(fleet.address, APP, replicas=2, timeout_s=180)
    base_url = f"http://127.0.0.1:{fleet.config.server.http_port}/{APP}/v1"
    with openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=120) as client:

        def respond(text: str, previous: str | None = None) -> openai.types.responses.Response:
            return client.responses.create(
                model=APP, input=text, previous_response_id=previous, max_output_tokens=6, temperature=0
            )

        chains = []
        for i in range(6):  # six conversations: both replicas own some
            first = respond(notes(i))
            chains.append((first, respond("Which items are boats?", first.id)))
        fork = respond("Which items are cats?", chains[0][0].id)  # an older response continued: a fork
        deploy(fleet, 2)  # every replica replaced, one after the other
        shares = []
        for first, last in [*chains, (chains[0][0], fork)]:
            for kept in (first, last):
                got = client.responses.retrieve(kept.id)
                assert got.id == kept.id and got.output_text == kept.output_text
            more = respond("And which are trees?", last.id)
            assert more.usage is not None and more.usage.input_tokens > last.usage.input_tokens  # type: ignore[union-attr]
            shares.append(more.usage.input_tokens_details.cached_tokens / more.usage.input_tokens)
    # Every record moved (they had no other copy); the caches too, with room for a session whose
    # second hand-over races the replacement (as test_fleet.py allows).
    assert sum(share >= 0.8 for share in shares) >= len(shares) - 2, shares
    print(f"\ncached shares after the roll: {[round(s, 2) for s in shares]} ({time.monotonic() - t0:.0f} s)")
