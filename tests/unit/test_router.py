"""``SessionAffinityRouter.choose_replicas`` with fake replicas, as Ray's own router tests do:
no cluster, the router built directly, requests shaped like the gRPC proxy's and a handle's."""

from __future__ import annotations

import asyncio
import pickle
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hotloop.v1 import model_pb2, session_pb2
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    gRPCRequest,
)
from ray.serve.request_router import PendingRequest

from hotloop_serve.serve.router import (
    MAX_DECODED_BYTES,
    UNAVAILABLE_HOLD_S,
    SessionAffinityRouter,
    peer_address,
    replica_names,
)
from hotloop_serve.serve.session_ids import SessionIds

DEPLOYMENT = DeploymentID(name="ModelDeployment", app_name="gemma-3-270m")
IDS = SessionIds(b"secret", "gemma-3-270m")


@dataclass
class FakeReplica:
    """What the router reads of a ``RunningReplica``: its id and the metadata it published."""

    unique_id: str
    rank: int | None
    reported_rank: int | None = None
    """The rank in its routing stats (polled by Ray), once Ray reassigned it."""
    replica_id: ReplicaID = field(init=False)
    replica_metadata: dict[str, Any] = field(init=False)
    routing_stats: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.replica_id = ReplicaID(unique_id=self.unique_id, deployment_id=DEPLOYMENT)
        self.replica_metadata = {} if self.rank is None else {"rank": self.rank}
        self.routing_stats = {} if self.reported_rank is None else {"rank": self.reported_rank}


def replicas(n: int, prefix: str = "r") -> list[FakeReplica]:
    return [FakeReplica(f"{prefix}{i}", i) for i in range(n)]


def pending(request: Any, *, from_proxy: bool = True, method: str = "", session_id: str = "") -> PendingRequest:
    """A request as the router sees it: from the gRPC proxy a pickled ``gRPCRequest`` (and the
    ``session_id`` metadata the SDKs send); from a deployment handle (create_session_here) the
    proto itself. ``method`` defaults to the RPC named by the request's type."""
    arg = pickle.dumps(gRPCRequest(user_request_proto=request)) if from_proxy else request
    method = method or type(request).__name__.removesuffix("Request")
    metadata = RequestMetadata(request_id="r", internal_request_id="i", call_method=method, session_id=session_id)
    return PendingRequest(args=[arg], kwargs={}, metadata=metadata)


def choose(
    router: SessionAffinityRouter, candidates: Sequence[FakeReplica], request: PendingRequest | None
) -> list[list[str]]:
    """The tiers, as replica ids (run on the test's event loop)."""
    loop = asyncio.get_event_loop()
    tiers = loop.run_until_complete(router.choose_replicas(list(candidates), request))  # type: ignore[arg-type]
    return [[r.unique_id for r in tier] for tier in tiers]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """Ray's router and PendingRequest (a future) want a current event loop; none may leak."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    pending_tasks = asyncio.all_tasks(loop)
    loop.close()
    asyncio.set_event_loop(None)
    assert not pending_tasks, pending_tasks


@pytest.fixture
def router(loop: asyncio.AbstractEventLoop) -> SessionAffinityRouter:
    return SessionAffinityRouter(DEPLOYMENT, DeploymentHandleSource.PROXY)


def test_every_rpc_of_a_session_goes_to_the_same_owner_only_generate_spills(router: SessionAffinityRouter) -> None:
    pool = replicas(4)
    for key in ("key-00000001", "key-00000002", "another-key", "k" * 64):
        sid = IDS.new("alice", key)
        generate = choose(router, pool, pending(session_pb2.GenerateRequest(session_id=sid)))
        # Generate: one replica per tier, each once: the owner, then the deterministic fallbacks.
        assert all(len(tier) == 1 for tier in generate)
        assert sorted(tier[0] for tier in generate) == sorted(r.unique_id for r in pool)
        owner_only = [generate[0]]
        create = session_pb2.CreateSessionRequest(model="m", session_key=key)
        requests = [
            pending(create),
            pending(create, from_proxy=False, method="create_session_here"),  # through the deployment handle
            pending(session_pb2.WarmupRequest(session_id=sid)),
            pending(session_pb2.GetSessionRequest(session_id=sid)),
            pending(session_pb2.UpdateSettingsRequest(session_id=sid)),
            pending(session_pb2.ClearCacheRequest(session_id=sid)),
            pending(session_pb2.CloseSessionRequest(session_id=sid)),
        ]
        for request in requests:  # a control RPC elsewhere would act on nothing: owner or wait
            assert choose(router, pool, request) == owner_only, (key, request.metadata.call_method)


def test_the_key_is_read_from_metadata_without_decoding(router: SessionAffinityRouter) -> None:
    pool = replicas(4)
    sid = IDS.new("alice", "metadata-key")
    from_proto = choose(router, pool, pending(session_pb2.GenerateRequest(session_id=sid)))
    # What the SDKs send: the key as metadata; the (possibly 4 MiB) request is never unpickled.
    opaque = PendingRequest(
        args=[b"not a pickle"],
        kwargs={},
        metadata=RequestMetadata("r", "i", call_method="Generate", session_id="metadata-key"),
    )
    assert choose(router, pool, opaque) == from_proto


def test_a_large_request_without_metadata_is_not_unpickled(router: SessionAffinityRouter) -> None:
    pool = replicas(3)
    big = session_pb2.GenerateRequest(session_id=IDS.new("a", "big-history"))
    big.messages.add(content="x" * (MAX_DECODED_BYTES + 1))
    assert choose(router, pool, pending(big)) == [["r0", "r1", "r2"]]
    assert len(choose(router, pool, pending(big, session_id="big-history"))) == 3


def test_the_ranking_ignores_candidate_order_and_router_instance(router: SessionAffinityRouter) -> None:
    pool = replicas(5)
    request = pending(session_pb2.GenerateRequest(session_id=IDS.new("bob", "order-test-key")))
    expected = choose(router, pool, request)
    other = SessionAffinityRouter(DEPLOYMENT, DeploymentHandleSource.REPLICA)  # e.g. another proxy
    rng = random.Random(7)
    for _ in range(10):
        shuffled = pool[:]
        rng.shuffle(shuffled)
        assert choose(router, shuffled, request) == expected
        assert choose(other, shuffled, request) == expected


def test_sessions_spread_over_the_replicas(router: SessionAffinityRouter) -> None:
    pool = replicas(3)
    owners = [
        choose(router, pool, pending(session_pb2.GenerateRequest(session_id=IDS.new("a", f"spread-{i:04d}"))))[0][0]
        for i in range(300)
    ]
    counts = {r.unique_id: owners.count(r.unique_id) for r in pool}
    assert all(60 <= c <= 140 for c in counts.values()), counts


@pytest.mark.parametrize(
    "request_",
    [
        model_pb2.ListModelsRequest(),
        model_pb2.GetModelRequest(model="m"),
        model_pb2.TokenizeRequest(model="m", text="hi"),
        session_pb2.CreateSessionRequest(model="m"),  # a stock client's: no key yet
        session_pb2.GetSessionRequest(),
    ],
)
def test_requests_without_a_key_go_to_one_tier_of_all(router: SessionAffinityRouter, request_: Any) -> None:
    pool = replicas(3)
    assert choose(router, pool, pending(request_)) == [["r0", "r1", "r2"]]


def test_no_request_garbage_or_one_replica_is_one_tier(router: SessionAffinityRouter) -> None:
    pool = replicas(3)
    assert choose(router, pool, None) == [["r0", "r1", "r2"]]
    garbage = PendingRequest(args=[b"not a pickle"], kwargs={}, metadata=RequestMetadata("r", "i"))
    assert choose(router, pool, garbage) == [["r0", "r1", "r2"]]
    request = pending(session_pb2.GetSessionRequest(session_id=IDS.new("a", "single-key")))
    assert choose(router, pool[:1], request) == [["r0"]]


def test_a_replacement_replica_inherits_its_ranks_sessions(router: SessionAffinityRouter) -> None:
    # Ray gives the replacement of a dead replica the dead one's rank: its sessions come back
    # to it, and no other session moves.
    pool = replicas(3)
    requests = [pending(session_pb2.GetSessionRequest(session_id=IDS.new("a", f"replace-{i:03d}"))) for i in range(60)]
    before = [choose(router, pool, r)[0][0] for r in requests]
    replaced = [pool[0], FakeReplica("new-replica", 1), pool[2]]
    after = [choose(router, replaced, r)[0][0] for r in requests]
    assert [o.replace("new-replica", "r1") for o in after] == before


def test_removing_a_replica_moves_only_its_sessions(router: SessionAffinityRouter) -> None:
    pool = replicas(4)
    requests = [pending(session_pb2.GenerateRequest(session_id=IDS.new("a", f"remove-{i:03d}"))) for i in range(80)]
    before = [choose(router, pool, r) for r in requests]
    after = [choose(router, pool[:3], r)[0][0] for r in requests]
    moved = 0
    for ranking, owner in zip(before, after, strict=True):
        if ranking[0][0] != "r3":
            assert owner == ranking[0][0]
        else:  # its sessions go to their second choice: the replica Ray already fell back to
            assert owner == ranking[1][0]
            moved += 1
    assert 0 < moved < len(requests) / 2


def test_an_unavailable_owner_ranks_last_until_it_answers(
    router: SessionAffinityRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the gRPC transport a dead replica is only *unavailable* to Ray: its sessions go to
    their runner-up at once (every RPC, not only Generate), and come back when it answers a
    probe again or the hold expires."""
    pool = replicas(3)
    sid = IDS.new("a", "unavailable-owner")
    generate = pending(session_pb2.GenerateRequest(session_id=sid))
    get = pending(session_pb2.GetSessionRequest(session_id=sid))
    ranking = [tier[0] for tier in choose(router, pool, generate)]
    owner = next(r for r in pool if r.unique_id == ranking[0])
    router.on_replica_actor_unavailable(owner.replica_id)
    assert [tier[0] for tier in choose(router, pool, generate)] == [*ranking[1:], ranking[0]]
    assert choose(router, pool, get) == [[ranking[1]]]
    router.on_new_queue_len_info(owner.replica_id, 0)  # it answered a probe
    assert choose(router, pool, get) == [[ranking[0]]]
    router.on_replica_actor_unavailable(owner.replica_id)
    later = router.clock() + UNAVAILABLE_HOLD_S + 1
    monkeypatch.setattr(router, "clock", lambda: later)
    assert choose(router, pool, get) == [[ranking[0]]]  # the hold expired: tried again


def test_a_replica_without_a_published_rank_hashes_on_its_id(router: SessionAffinityRouter) -> None:
    pool = [FakeReplica("a", None), FakeReplica("b", None)]
    request = pending(session_pb2.GenerateRequest(session_id=IDS.new("a", "unranked-key")))
    ranking = choose(router, pool, request)
    assert sorted(t[0] for t in ranking) == ["a", "b"]
    assert choose(router, pool[::-1], request) == ranking


def test_no_tasks_are_left_behind(router: SessionAffinityRouter, loop: asyncio.AbstractEventLoop) -> None:
    pool = replicas(3)
    for i in range(20):
        choose(router, pool, pending(session_pb2.GetSessionRequest(session_id=f"k{i:07d}.s")))
    assert asyncio.all_tasks(loop) == set()


def test_a_reassigned_rank_wins_over_the_one_published_at_start(router: SessionAffinityRouter) -> None:
    # After a downscale Ray may renumber ranks; the replica reports its new one in its routing
    # stats, while its start-up metadata is frozen. Routing follows the report.
    before = [FakeReplica("r0", 0), FakeReplica("r2", 2)]
    after = [FakeReplica("r0", 0), FakeReplica("r2", 2, reported_rank=1)]
    renamed = [FakeReplica("r0", 0), FakeReplica("r2", 1)]
    requests = [pending(session_pb2.GenerateRequest(session_id=IDS.new("a", f"rerank-{i:03d}"))) for i in range(40)]
    assert [choose(router, after, r) for r in requests] == [choose(router, renamed, r) for r in requests]
    assert [choose(router, after, r) for r in requests] != [choose(router, before, r) for r in requests]


def test_two_replicas_claiming_one_rank_are_told_apart_deterministically(router: SessionAffinityRouter) -> None:
    # A stale report during a reassignment: both say rank 0. The smaller id keeps it, in any order.
    pool = [FakeReplica("b-replica", 0), FakeReplica("a-replica", 1, reported_rank=0), FakeReplica("c-replica", 2)]
    assert replica_names(pool) == ["b-replica", "0", "2"]  # type: ignore[arg-type]
    assert replica_names(pool[::-1]) == ["2", "0", "b-replica"]  # type: ignore[arg-type]
    requests = [pending(session_pb2.GenerateRequest(session_id=IDS.new("a", f"tie-key-{i:03d}"))) for i in range(30)]
    for request in requests:
        owners = {choose(router, order, request)[0][0] for order in (pool, pool[::-1], pool[1:] + pool[:1])}
        assert len(owners) == 1


def test_a_peer_address_reaches_each_other_replica_whatever_its_rank(router: SessionAffinityRouter) -> None:
    # Replicas reach each other by index among their peers in replica-id order (fetching a
    # session after a fleet change): the same replica in every router, renumbered or not, and
    # never the caller.
    pool = [FakeReplica("r2", 2, reported_rank=1), FakeReplica("r0", 0), FakeReplica("r3", 3)]
    for method in ("give_session", "list_sessions_here", "Generate"):

        def at(i: int, caller: str, candidates: list[FakeReplica], method: str = method) -> list[list[str]]:
            request = pending(session_pb2.ImportSessionRequest(session_key=peer_address(i, caller)), method=method)
            return choose(router, candidates, request)

        assert [at(i, "r0", pool) for i in range(2)] == [[["r2"]], [["r3"]]]
        assert [at(i, "r3", pool[::-1]) for i in range(2)] == [[["r0"]], [["r2"]]]
        assert at(2, "r0", pool) == [["r2"]]  # past the peers known: wraps around
        assert at(0, "r0", [pool[1]]) == [[]]  # no peer known yet: Ray waits and retries


def test_a_request_that_cannot_be_routed_yet_backs_off_and_a_cancelled_one_stops(
    router: SessionAffinityRouter, loop: asyncio.AbstractEventLoop
) -> None:
    # Ray's retry loop re-asks the router without sleeping unless the router says to back off:
    # a peer lookup with no peer, or a control RPC whose owner is full, spun a core until routed.
    pool = [FakeReplica("r0", 0)]
    lookup = pending(session_pb2.ImportSessionRequest(session_key=peer_address(0, "r0")), method="give_session")
    assert choose(router, pool, lookup) == [[]]
    assert lookup.routing_context.should_backoff
    control = pending(session_pb2.GetSessionRequest(session_id=IDS.new("a", "backoff-key")))
    choose(router, replicas(3), control)
    assert control.routing_context.should_backoff
    # Its caller gave up: a tier lets Ray's loop see the cancelled future and drop the request.
    lookup.future.cancel()
    assert choose(router, pool, lookup) == [["r0"]]
