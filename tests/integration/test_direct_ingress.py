"""Direct ingress (``server.direct_ingress``): each replica's own gRPC server, listed by
``ListReplicas``, and the SDK's ``direct=True`` sending each session's turns to its owner.

Two replicas of the synthetic engine (its own application on the shared server): turns sent
directly land on the replica the proxy's router would pick and reply in full; a replica whose
direct address does not answer costs nothing but a detour through the proxy.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from hotloop.v1 import model_pb2, model_pb2_grpc
from hotloop_client import Chunk, Client, Message, Role, Settings, _base

from hotloop_serve.serve.direct_ingress import ROUTING

from .conftest import Server, synthetic_app

pytestmark = pytest.mark.integration
APP = "direct-ingress"
TOKENS = 24


@pytest.fixture(scope="module")
def direct_app(server: Server) -> Iterator[Server]:
    engine = {"synthetic_step_ms": 5, "hot_sessions": 8, "context_tokens": 8192, "session_context_tokens": 1024}
    model = {"replicas": 2, "resources": {"num_cpus": 0.25}}
    with synthetic_app(server, APP, engine, model, {"direct_ingress": True}) as app:
        yield app


def list_replicas(address: str, app: str = APP) -> model_pb2.ListReplicasResponse:
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        return stub.ListReplicas(model_pb2.ListReplicasRequest(model=app), metadata=[("application", app)], timeout=30)


def test_list_replicas_names_each_replica_s_own_server(direct_app: Server) -> None:
    listed = list_replicas(direct_app.address)
    assert listed.routing == ROUTING and listed.refresh_s > 0
    assert sorted(r.rank for r in listed.replicas) == [0, 1]
    for replica in listed.replicas:
        host, _, port = replica.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) != int(direct_app.address.rsplit(":", 1)[1])
        # The replica's own server speaks the same API: a model call answered without the proxy.
        with grpc.insecure_channel(replica.address) as channel:
            info = model_pb2_grpc.ModelServiceStub(channel).GetModel(model_pb2.GetModelRequest(model=APP), timeout=30)
        assert info.name == APP


def test_direct_turns_reach_the_owner_the_router_would_pick(direct_app: Server) -> None:
    listed = {r.rank: r.address for r in list_replicas(direct_app.address).replicas}
    settings = Settings(temperature=0, sample_len=TOKENS)
    with Client(direct_app.address, direct=True) as client:
        model = client.model(APP)
        ranks = set()
        for i in range(6):
            with model.new_session(settings=settings) as session:
                chunks = list(session.generate([Message(Role.USER, f"direct {i}")]))
                owner = _base.owner_rank(session.id.split(".", 1)[0], listed)
                ranks.add(owner)
                final = chunks[-1]
                assert final.usage is not None and final.usage.completion_tokens == TOKENS
                assert final.served_by is not None and final.served_by.replica_rank == owner
                follow = list(
                    session.generate([Message(Role.USER, f"direct {i}"), *_reply(chunks), Message(Role.USER, "more")])
                )
                assert follow[-1].usage is not None and follow[-1].usage.cached_tokens > 0  # its cache was there
        assert set(client._stubs.replicas) == {listed[r] for r in ranks}  # the turns went direct


def _reply(chunks: list[Chunk]) -> list[Message]:
    return [Message(Role.ASSISTANT, "".join(c.text for c in chunks))]


def test_a_replica_that_does_not_answer_directly_is_reached_through_the_proxy(direct_app: Server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    settings = Settings(temperature=0, sample_len=TOKENS)
    with Client(direct_app.address, direct=True) as client:
        session = client.model(APP).new_session(settings=settings)
        list(session.generate([Message(Role.USER, "warm the routes")]))
        routes = client._stubs.routes[APP]
        routes._addresses = {rank: dead for rank in routes._addresses}  # every replica "gone"
        chunks = list(session.generate([Message(Role.USER, "still answered")]))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
        assert routes.address_for(session.id.split(".", 1)[0], _base.now()) is None  # avoided for now
        session.close()
