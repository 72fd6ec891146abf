"""Session operations through the real server: fork, edit, list, export/import, restart from disk.

Runs against its own application (``gemma-sessions``: two replicas, bearer tokens, a disk
tier in a temporary directory) plus the shared ``gemma-duo`` (anonymous) for importing into
another deployment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hotloop_client import (
    Client,
    InvalidArgument,
    Message,
    Role,
    Session,
    Settings,
    with_message_replaced,
    without_last_reply,
)
from ray import serve

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.serve.app import model_app

from .conftest import DUO, Server, wait_until_every_replica_serves

pytestmark = pytest.mark.integration
APP = "gemma-sessions"
LIST_APP = "gemma-sessions-duo"
GREEDY = Settings(temperature=0, sample_len=12, repeat_penalty=1.0)


def fleet_secret() -> str:
    """The session secret of the shared server's apps (set by the ``server`` fixture): exports move
    between deployments that share it (their blobs are signed with it; docs/sessions.md)."""
    return os.environ["HOTLOOP_SESSION_SECRET"]


TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}


def app_config(server: Server, persist: Path | None, name: str = APP, replicas: int = 1) -> Config:
    doc = server.config.model_dump(mode="json")
    doc["auth"] = {"tokens": TOKENS}
    doc["models"] = [
        {
            "name": name,
            "replicas": replicas,
            "engine": {"context_tokens": 8192, "session_context_tokens": 4096, "hot_sessions": 4, "threads": 2,
                       "persist_dir": str(persist) if persist else ""},
            "resources": {"num_cpus": 0.5},
        }
    ]  # fmt: skip
    return config_from_dict(doc)


@pytest.fixture(scope="module")
def sessions_app(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Config]]:
    config = app_config(server, tmp_path_factory.mktemp("persist"))
    serve.run(model_app(config, config.models[0], fleet_secret()), name=APP, route_prefix=f"/{APP}")
    yield server.address, config
    if serve.status().applications.get(APP) is not None:
        serve.delete(APP)


@pytest.fixture(scope="module")
def sessions_duo(server: Server) -> Iterator[str]:
    """Two replicas with bearer tokens, for listing a principal's sessions across replicas."""
    config = app_config(server, None, LIST_APP, replicas=2)
    serve.run(model_app(config, config.models[0], fleet_secret()), name=LIST_APP, route_prefix=f"/{LIST_APP}")
    wait_until_every_replica_serves(server.address, LIST_APP, replicas=2, timeout_s=180, token=TOKENS["alice"])
    yield server.address
    if serve.status().applications.get(LIST_APP) is not None:
        serve.delete(LIST_APP)


def turns(n: int) -> list[Message]:
    history = [Message(Role.SYSTEM, "You are a helpful assistant.")]
    for i in range(n):
        history += [Message(Role.USER, f"Tell me fact number {i} about the sea."), Message(Role.ASSISTANT, f"Fact {i}")]
    return history


def alice(address: str) -> Client:
    return Client(address, token=TOKENS["alice"])


def reply(client: Client, model: str, history: list[Message]) -> str:
    with client.model(model).new_session(settings=GREEDY) as fresh:
        return "".join(c.text for c in fresh.generate(history))


def test_fork_then_diverge(sessions_app: tuple[str, Config]) -> None:
    address, _ = sessions_app
    with alice(address) as client:
        base = turns(3)
        src = client.model(APP).new_session(settings=GREEDY)
        list(src.generate([*base, Message(Role.USER, "One more?")]))
        fork = src.fork(base)  # the cache up to the end of turn 3
        kept = fork.context()
        assert 0 < kept < src.context()
        whole = src.fork()  # no history: all of the cache
        assert whole.context() == src.context()
        whole.close()
        left = [*base, Message(Role.USER, "Now about rivers.")]
        right = [*base, Message(Role.USER, "Now about mountains.")]
        a = list(src.generate(left))
        b = list(fork.generate(right))
        assert b[-1].usage is not None and b[-1].usage.cached_tokens == kept
        assert "".join(c.text for c in a) == reply(client, APP, left)
        assert "".join(c.text for c in b) == reply(client, APP, right)


def test_edit_turn_one_of_four_and_regenerate(sessions_app: tuple[str, Config]) -> None:
    address, _ = sessions_app
    with alice(address) as client:
        session = client.model(APP).new_session(settings=GREEDY)
        history = [*turns(4), Message(Role.USER, "And the last one?")]
        list(session.generate(history))
        edited = with_message_replaced(history, 1, "Tell me one fact about lakes.")
        chunks = list(session.generate(edited))
        usage = chunks[-1].usage
        assert usage is not None and 0 < usage.cached_tokens < 40  # exactly the tokens before the edit
        assert "".join(c.text for c in chunks) == reply(client, APP, edited)
        answered = [*edited, Message(Role.ASSISTANT, "".join(c.text for c in chunks))]
        again = list(session.regenerate(answered))
        assert again[-1].usage is not None and again[-1].usage.cached_tokens >= again[-1].usage.prompt_tokens - 1
        assert "".join(c.text for c in again) == "".join(c.text for c in chunks)  # greedy: the same reply
        with pytest.raises(ValueError):
            without_last_reply(edited)


def test_list_across_two_replicas(sessions_duo: str) -> None:
    address = sessions_duo
    with alice(address) as client, Client(address, token=TOKENS["bob"]) as bob:
        model = client.model(LIST_APP)
        # Session ids rendezvous-hash onto replicas, so six sessions all land on one replica
        # one time in 32: open sessions until both replicas own some (1 in 2**19 to fail).
        sessions: list[Session] = []
        replicas: set[str] = set()
        while len(sessions) < 6 or (len(replicas) < 2 and len(sessions) < 20):
            s = model.new_session(settings=GREEDY)
            sessions.append(s)
            chunks = list(s.generate([Message(Role.USER, f"Hello number {len(sessions)}")]))
            assert chunks[-1].served_by is not None
            replicas.add(chunks[-1].served_by.replica)
        listed = {info.id: info for info in model.list_sessions()}
        for s in sessions:
            assert s.id in listed and listed[s.id].context_tokens > 0, (s.id, listed)
        served = {info.served_by.replica for info in listed.values() if info.served_by}
        assert len(replicas) == 2 and served >= replicas, (replicas, served)
        assert not {info.id for info in bob.model(LIST_APP).list_sessions()} & listed.keys()
        for s in sessions:
            s.close()


def test_anonymous_callers_share_nothing(server: Server) -> None:
    """No prefix copy between unrelated anonymous sessions, and nothing to list."""
    with Client(server.address) as a, Client(server.address) as b:
        system = [Message(Role.SYSTEM, "A long shared system prompt about harbours. " * 12)]
        first = a.model(DUO).new_session(settings=GREEDY)
        list(first.generate([*system, Message(Role.USER, "one")]))
        other = b.model(DUO).new_session(settings=GREEDY)
        last = list(other.generate([*system, Message(Role.USER, "two")]))[-1]
        assert last.usage is not None and last.usage.cached_tokens == 0
        assert b.model(DUO).list_sessions() == []


def test_export_then_import_into_another_deployment(sessions_app: tuple[str, Config]) -> None:
    address, _ = sessions_app
    with alice(address) as client:
        history = turns(3)
        src = client.model(APP).new_session(settings=GREEDY)
        list(src.generate(history))
        blob = src.export()
        follow = [*history, Message(Role.USER, "And then?")]
        expected = list(src.generate(follow))
        imported = client.model(DUO).import_session(blob, settings=GREEDY)
        got = list(imported.generate(follow))
        assert got[-1].usage is not None and expected[-1].usage is not None
        assert got[-1].usage.cached_tokens == expected[-1].usage.cached_tokens > 0
        assert "".join(c.text for c in got) == "".join(c.text for c in expected)
        damaged = bytearray(blob)
        damaged[len(blob) // 3] ^= 1
        with pytest.raises(InvalidArgument):
            client.model(DUO).import_session(bytes(damaged))
        with pytest.raises(InvalidArgument):
            client.model(DUO).import_session(blob[:-10])
        imported.close()


def test_a_restarted_server_resumes_sessions_from_disk(sessions_app: tuple[str, Config]) -> None:
    address, config = sessions_app
    history = [*turns(6), Message(Role.USER, "Summarise all of that.")]
    with alice(address) as client:
        session = client.model(APP).new_session(settings=GREEDY)
        list(session.generate(history))
        answered = [*history, Message(Role.ASSISTANT, "Done."), Message(Role.USER, "Thanks. And after that?")]
        serve.delete(APP)  # graceful: the replica writes its sessions to the disk tier
        serve.run(model_app(config, config.models[0], fleet_secret()), name=APP, route_prefix=f"/{APP}")
        t0 = time.monotonic()
        chunks = list(session.generate(answered))
        usage = chunks[-1].usage
        assert usage is not None and usage.restored_tokens >= usage.prompt_tokens - 30 > 100, usage
        assert "".join(c.text for c in chunks) == reply(client, APP, answered)
        assert time.monotonic() - t0 < 60
