"""Sessions keep their caches while the fleet changes: a rolling replacement of every replica.

``serve.run`` of a changed application replaces its replicas (as a rolling upgrade does):
each leaving replica hands its cached sessions to their next owners during Ray's graceful
shutdown, and a replica that owns a session it does not hold fetches it from the previous
owner on first use. Follow-up turns then find their history cached instead of re-prefilling.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from hotloop_client import Client, Message, Role, Settings
from ray import serve

from hotloop_serve.config import config_from_dict
from hotloop_serve.serve.app import model_app

from .conftest import Server, wait_until_every_replica_serves

pytestmark = pytest.mark.integration
APP = "gemma-fleet"
SECRET = "fleet-secret-0123456789abcdef0123"
GREEDY = Settings(temperature=0, sample_len=8, repeat_penalty=1.0)


def deploy(server: Server, handover: bool, generation: int) -> None:
    doc = server.config.model_dump(mode="json")
    doc["models"] = [
        {
            "name": APP,
            "replicas": 2,
            "engine": {"context_tokens": 8192, "session_context_tokens": 2048, "hot_sessions": 8, "threads": 1,
                       "seed": generation},  # a changed option: Ray replaces every replica
            "resources": {"num_cpus": 0.5},
            "handover": handover,
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


def history(i: int) -> list[Message]:
    notes = " ".join(f"Item {j} of list {i} is a {['cat', 'boat', 'tree'][j % 3]}." for j in range(40))
    return [Message(Role.USER, f"Remember list {i}: {notes}")]


def cached_share_after_replacement(server: Server, handover: bool) -> dict[str, Any]:
    deploy(server, handover, 1)
    wait_until_every_replica_serves(server.address, APP, replicas=2, timeout_s=180)
    with Client(server.address) as client:
        sessions = [client.model(APP).new_session(settings=GREEDY) for _ in range(6)]
        replies = ["".join(c.text for c in s.generate(history(i))) for i, s in enumerate(sessions)]
        deploy(server, handover, 2)  # every replica replaced, one after the other
        shares, ttfts = [], []
        for i, s in enumerate(sessions):
            follow = [*history(i), Message(Role.ASSISTANT, replies[i]), Message(Role.USER, "Which items are boats?")]
            last = list(s.generate(follow))[-1]
            assert last.usage is not None and last.timings is not None
            shares.append((last.usage.cached_tokens + last.usage.restored_tokens) / last.usage.prompt_tokens)
            ttfts.append(last.timings.time_to_first_token_ms)
    return {"shares": shares, "ttft_ms": ttfts}


def test_a_rolling_replacement_keeps_session_caches(fleet: Server) -> None:
    t0 = time.monotonic()
    moved = cached_share_after_replacement(fleet, handover=True)
    # The target (>= 95% of moved sessions) is what bench/fleet.py reports; this guards the
    # mechanism with room for one session whose second hand-over races a replacement.
    assert sum(share >= 0.9 for share in moved["shares"]) >= 4, moved
    baseline = cached_share_after_replacement(fleet, handover=False)
    assert sum(share >= 0.9 for share in baseline["shares"]) == 0, baseline
    print(f"\nhandover on: {moved}\nhandover off: {baseline}\n({time.monotonic() - t0:.0f} s)")
