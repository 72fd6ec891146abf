"""The fleet component of a replica (``serve/fleet.py``), on fake handles: which replica each
call from a replica addresses, and what it asks there."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hotloop.v1 import session_pb2 as spb

from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.serve import fleet as fleet_module
from hotloop_serve.serve.fleet import ReplicaFleet, SoloFleet, key_owned_by
from hotloop_serve.serve.router import owner_of, peer_address, runner_up_of
from hotloop_serve.serve.session_ids import SessionIds, routing_key

IDS = SessionIds(b"k", "m")


class FakeHandle:
    """Records ``(session_id, method, args)`` of each call; ``answers`` by method."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.answers = answers
        self.key = ""

    def options(self, session_id: str = "", **_: Any) -> FakeHandle:
        routed = FakeHandle(self.answers)
        routed.calls, routed.key = self.calls, session_id
        return routed

    def __getattr__(self, method: str) -> Any:
        outer = self

        class Method:
            def remote(self, *args: Any) -> Any:
                outer.calls.append((outer.key, method, args))

                async def answer() -> Any:
                    value = outer.answers.get(method)
                    return value(outer.key) if callable(value) else value

                return answer()

        return Method()


class FakeEngine:
    def __init__(self) -> None:
        self.imported: list[tuple[str, str, bytes]] = []

    def known(self, sid: str) -> bool:
        return False

    def import_session(self, sid: str, tenant: str, blob: bytes) -> None:
        self.imported.append((sid, tenant, blob))


@pytest.fixture
def handle(monkeypatch: pytest.MonkeyPatch) -> FakeHandle:
    fake = FakeHandle({})
    monkeypatch.setattr(fleet_module.serve, "get_deployment_handle", lambda deployment, app: fake)
    monkeypatch.setattr(fleet_module, "running_by_app", lambda: {"app": 3})
    return fake


def fleet(rank: int, engine: FakeEngine | None = None) -> ReplicaFleet:
    return ReplicaFleet(engine or FakeEngine(), "app", "dep", f"replica-{rank}", rank)  # type: ignore[arg-type]


def test_a_keyed_create_runs_here_when_this_replica_owns_the_key_else_on_its_owner(handle: FakeHandle) -> None:
    ranks = ["0", "1", "2"]
    mine, theirs = key_owned_by(1, ranks), key_owned_by(2, ranks)
    f = fleet(1)
    assert asyncio.run(f.create_at_owner(spb.CreateSessionRequest(session_key=mine), "p", "c")) is None
    assert handle.calls == []
    handle.answers["create_session_here"] = spb.Session(id="made")
    request = spb.CreateSessionRequest(session_key=theirs)
    assert asyncio.run(f.create_at_owner(request, "p", "c")).id == "made"
    assert handle.calls == [(theirs, "create_session_here", (request, "p", "c"))]


def test_a_colocated_key_is_owned_by_this_replica(handle: FakeHandle) -> None:
    ranks = ["0", "1", "2"]
    f = fleet(2)
    mine = key_owned_by(2, ranks)
    assert asyncio.run(f.colocated_key(mine)) == mine
    other = asyncio.run(f.colocated_key(key_owned_by(0, ranks)))
    assert owner_of(other, ranks) == 2


def test_adopting_asks_every_peer_by_address_and_imports_the_longest_copy(handle: FakeHandle) -> None:
    ranks = ["0", "1", "2"]
    sid = next(s for s in (IDS.new("p", f"key-{i:04d}") for i in range(100)) if owner_of(routing_key(s), ranks) == 0)
    blobs = {peer_address(0, "replica-0"): b"short", peer_address(1, "replica-0"): b"the longer one"}
    handle.answers["give_session"] = blobs.get
    engine = FakeEngine()
    asyncio.run(fleet(0, engine).adopt(sid, "p"))
    assert sorted(handle.calls) == sorted((peer, "give_session", ("p", sid)) for peer in blobs)
    assert engine.imported == [(sid, "p", b"the longer one")]


def test_the_owner_sends_settings_to_its_runner_up_by_a_key_the_runner_up_owns(handle: FakeHandle) -> None:
    ranks = ["0", "1", "2"]
    sid = next(s for s in (IDS.new("p", f"key-{i:04d}") for i in range(100)) if owner_of(routing_key(s), ranks) == 0)
    runner_up = runner_up_of(routing_key(sid), ranks, "0")
    settings = SamplingSettings(temperature=0.5)
    asyncio.run(fleet(0)._tell_runner_up(sid, "p", settings))
    [(key, method, args)] = handle.calls
    assert (method, args) == ("remember_settings", ("p", sid, settings))
    assert owner_of(key, ranks) == runner_up


def test_a_replica_owns_the_keys_the_routers_send_it_and_a_lone_one_owns_all(handle: FakeHandle) -> None:
    """The HTTP path serves a turn here when this replica owns its key, instead of a handle call
    to itself that needs a second request slot (issue 37's finding: concurrent HTTP turns filled
    every slot and hung)."""
    ranks = ["0", "1", "2"]
    f = fleet(1)
    assert asyncio.run(f.owns(key_owned_by(1, ranks)))
    assert not asyncio.run(f.owns(key_owned_by(2, ranks)))
    assert asyncio.run(SoloFleet().owns("any"))
    assert handle.calls == []
