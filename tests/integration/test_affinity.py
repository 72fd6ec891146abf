"""Two replicas: every follow-up turn reaches its session's owner; a dead replica loses no turn."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import hotloop_client._base
import pytest
import ray
from hotloop.v1 import session_pb2, session_pb2_grpc
from hotloop_client import Chunk, Client, Message, Role, Session, Settings, TurnInterrupted

from hotloop_serve.serve.router import rendezvous_order
from hotloop_serve.serve.session_ids import routing_key

from .conftest import DUO, SINGLE, Server, wait_until_every_replica_serves

pytestmark = pytest.mark.integration
SETTINGS = Settings(temperature=0, sample_len=12)


def turn(session: Session, history: list[Message], text: str) -> Chunk:
    history.append(Message(Role.USER, text))
    chunks = list(session.generate(history))
    history.append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
    return chunks[-1]


def converse(
    client: Client, sessions: int, turns: int, concurrent: bool, ids: list[str] | None = None
) -> list[list[Chunk]]:
    """Each session's final chunks, turn by turn (and its id in ``ids``, if given)."""
    model = client.model(DUO)
    results: list[list[Chunk]] = [[] for _ in range(sessions)]
    if ids is not None:
        ids[:] = [""] * sessions

    def one(i: int) -> None:
        s = model.new_session(settings=SETTINGS)
        if ids is not None:
            ids[i] = s.id
        history = [Message(Role.SYSTEM, f"You are assistant number {i}.")]
        for t in range(turns):
            results[i].append(turn(s, history, f"Session {i}, question {t}: say something."))
        s.close()

    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(sessions)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    else:
        for i in range(sessions):
            one(i)
    return results


def affinity_share(results: list[list[Chunk]]) -> float:
    follow_ups = hits = 0
    for finals in results:
        owner = finals[0].served_by.replica  # type: ignore[union-attr]
        for c in finals[1:]:
            follow_ups += 1
            assert c.usage is not None and c.served_by is not None
            reused = c.usage.cached_tokens + c.usage.restored_tokens  # hot, or restored from the replica's RAM
            hits += c.served_by.replica == owner and c.served_by.cache_hit and reused > 0
    return hits / follow_ups


def balanced_keys(n: int, ranks: tuple[str, ...] = ("0", "1")) -> Iterator[str]:
    """Routing keys owned in turn by each rank (random keys put all 12 sessions on one of two
    replicas once in 2,048 runs, and the spread check below would then fail by chance). Fresh
    ones on every call: a closed session's key stays taken."""
    nonce = secrets.token_hex(4)
    for i in range(n):
        yield next(
            key
            for key in (f"affinity-{nonce}-{i}-{j}" for j in itertools.count())
            if rendezvous_order(key, list(ranks))[0] == i % len(ranks)
        )


@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_follow_ups_land_on_the_owner_and_reuse_its_cache(
    client: Client, concurrent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = balanced_keys(12)
    lock = threading.Lock()

    def next_key() -> str:
        with lock:
            return next(keys)

    monkeypatch.setattr(hotloop_client._base, "new_session_key", next_key)
    ids: list[str] = []
    results = converse(client, sessions=12, turns=4, concurrent=concurrent, ids=ids)
    assert all(len(r) == 4 for r in results)
    share = affinity_share(results)
    print(f"\naffinity ({'concurrent' if concurrent else 'sequential'}): {share:.1%} of 36 follow-ups hit")
    assert share >= 0.99
    # Sessions whose keys hash to rank 0 share one replica, rank 1's the other: both serve.
    by_rank: dict[int, set[str]] = {0: set(), 1: set()}
    for session_id, finals in zip(ids, results, strict=True):
        by_rank[rendezvous_order(routing_key(session_id), ["0", "1"])[0]].add(finals[0].served_by.replica)  # type: ignore[union-attr]
    assert len(by_rank[0]) == 1 and len(by_rank[1]) == 1 and by_rank[0] != by_rank[1]


def test_models_report_the_replicas_running(client: Client) -> None:
    """Serve runs the replica counts (`hotloop-serve apply` changes them in place): ModelInfo
    reports what runs, not the count in the config a replica was built from."""
    running = {m.name: m.replicas for m in client.list_models()}
    assert running[DUO] == 2 and running[SINGLE] == 1
    assert client.model(DUO).info().replicas == 2


def test_create_session_without_a_key_lands_on_the_owner(server: Server) -> None:
    """A stock client that sends no routing key: settings must still be where the turns go."""
    md = [("application", DUO)]
    with grpc.insecure_channel(server.address) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)
        for _ in range(6):
            created = stub.CreateSession(
                session_pb2.CreateSessionRequest(model=DUO, settings={"sample_len": 3, "temperature": 0}), metadata=md
            )
            got = stub.GetSession(session_pb2.GetSessionRequest(session_id=created.id), metadata=md)
            assert got.served_by.replica == created.served_by.replica
            assert got.settings.sample_len == 3
            msgs = [{"role": "ROLE_USER", "content": "Tell me a long story."}]
            final = list(stub.Generate(session_pb2.GenerateRequest(session_id=created.id, messages=msgs), metadata=md))
            assert final[-1].usage.completion_tokens <= 3


def replica_actors() -> list[str]:
    """Names of the duo app's live replica actors (named actors need no dashboard)."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["name"].startswith(f"SERVE_REPLICA::{DUO}#")]


def wait_for_replicas(address: str, n: int, timeout: float = 120) -> None:
    """Until Serve reports ``n`` RUNNING replicas and each of them owns and serves a turn.

    Serve calls a replacement RUNNING before the proxy's router has heard of it or it answers
    the router's queue probes in time; a turn sent then runs on the next-ranked replica.
    """
    from ray import serve

    deadline = time.monotonic() + timeout
    while serve.status().applications[DUO].deployments[DUO].replica_states.get("RUNNING", 0) < n:
        assert time.monotonic() < deadline, "replica was not replaced"
        time.sleep(0.5)
    wait_until_every_replica_serves(address, DUO, replicas=n, timeout_s=timeout)


def test_killing_a_replica_loses_no_turn(client: Client) -> None:
    model = client.model(DUO)
    sessions = [model.new_session(settings=SETTINGS) for _ in range(6)]
    histories: list[list[Message]] = [[] for _ in sessions]
    firsts = [turn(s, h, "Hello, who are you?").served_by for s, h in zip(sessions, histories, strict=True)]
    victim_id = firsts[0].replica  # type: ignore[union-attr]
    victim = next(name for name in replica_actors() if name.endswith(victim_id))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
    for s, h in zip(sessions, histories, strict=True):  # every conversation continues
        final = turn(s, h, "Tell me more.")
        assert final.usage is not None and final.usage.completion_tokens > 0
    assert all(len(h) == 4 for h in histories)  # two user turns + two replies each: none lost or doubled
    wait_for_replicas(client.address, 2)
    for s, h, first in zip(sessions, histories, firsts, strict=True):
        # The replacement inherits the dead replica's rank and takes back exactly its sessions
        # (rebuilding their caches from history once); the others stay where they were.
        final = turn(s, h, "And finally?")
        assert final.served_by is not None and first is not None
        assert final.served_by.replica_rank == first.replica_rank
        again = turn(s, h, "One more thing.")
        assert again.usage is not None and again.usage.cached_tokens > 0


def stock_turn(stub: session_pb2_grpc.SessionServiceStub, session_id: str, text: str) -> session_pb2.GenerateChunk:
    """A turn from a client with no SDK: no settings, no key metadata; retried while the proxy
    still routes to a replica that was just killed (what any client does on UNAVAILABLE)."""
    msgs = [{"role": "ROLE_USER", "content": text}]
    request = session_pb2.GenerateRequest(session_id=session_id, messages=msgs)
    deadline = time.monotonic() + 60
    while True:
        try:
            return list(stub.Generate(request, metadata=[("application", DUO)], timeout=120))[-1]
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                raise
            time.sleep(0.5)


def test_a_stock_clients_settings_outlive_its_owner(server: Server) -> None:
    """Settings set once at CreateSession hold on the runner-up while the owner is dead, and on
    the owner's replacement after: the owner told its runner-up, which hands them on."""
    wait_for_replicas(server.address, 2)
    with grpc.insecure_channel(server.address) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)
        settings = {"sample_len": 3, "temperature": 0}
        created = stub.CreateSession(
            session_pb2.CreateSessionRequest(model=DUO, settings=settings), metadata=[("application", DUO)]
        )
        first = stock_turn(stub, created.id, "Tell me a long story.")
        assert first.usage.completion_tokens == 3
        owner = first.served_by
        time.sleep(1)  # the owner tells its runner-up in the background
        ray.kill(ray.get_actor(next(n for n in replica_actors() if n.endswith(owner.replica)), namespace="serve"))
        during = stock_turn(stub, created.id, "Go on.")
        assert during.served_by.replica != owner.replica
        assert during.usage.completion_tokens == 3  # not the server's default of 256
        wait_for_replicas(server.address, 2)
        after = stock_turn(stub, created.id, "And then?")
        assert after.served_by.replica_rank == owner.replica_rank and after.served_by.replica != owner.replica
        assert after.usage.completion_tokens == 3


def test_replica_killed_mid_stream(client: Client) -> None:
    wait_for_replicas(client.address, 2)
    session = client.model(DUO).new_session(settings=Settings(temperature=0, sample_len=200))
    history = [Message(Role.USER, "Write a very long story about a lighthouse keeper.")]
    received: list[str] = []
    error: list[BaseException] = []

    def stream() -> None:
        try:
            for c in session.generate(history):
                received.append(c.text)
        except BaseException as e:
            error.append(e)

    th = threading.Thread(target=stream)
    th.start()
    while not received:
        time.sleep(0.01)
    owner = session.info().served_by.replica  # type: ignore[union-attr]
    ray.kill(ray.get_actor(next(n for n in replica_actors() if n.endswith(owner)), namespace="serve"))
    th.join(120)
    assert error and isinstance(error[0], TurnInterrupted)
    assert error[0].partial_text == "".join(received)
    # The caller's history is unchanged; retrying the turn works (on the next-ranked replica).
    final = list(session.generate(history, sample_len=8))[-1]
    assert final.usage is not None and final.usage.completion_tokens > 0
    wait_for_replicas(client.address, 2)
