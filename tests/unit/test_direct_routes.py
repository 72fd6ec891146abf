"""The SDK's direct routing (``direct=True``) agrees with the server's router, and falls back to
the proxy where it does not know better."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hotloop.v1 import common_pb2, model_pb2, model_pb2_grpc, session_pb2, session_pb2_grpc
from hotloop_client import AsyncClient, Chunk, Client, _base
from hotloop_client._errors import rich_details

from hotloop_serve.serve import direct_ingress
from hotloop_serve.serve.router import owner_of


@pytest.mark.parametrize("replicas", [1, 2, 3, 5, 8])
def test_the_sdk_hashes_a_session_key_to_the_owner_the_router_picks(replicas: int) -> None:
    ranks = list(range(replicas))
    for _ in range(300):
        key = secrets.token_urlsafe(16)
        assert _base.owner_rank(key, ranks) == owner_of(key, [str(r) for r in ranks])
    assert _base.DIRECT_ROUTING == direct_ingress.ROUTING


def listing(*addresses: str, routing: str = direct_ingress.ROUTING) -> model_pb2.ListReplicasResponse:
    replicas = [model_pb2.ReplicaAddress(rank=i, address=a) for i, a in enumerate(addresses)]
    return model_pb2.ListReplicasResponse(model="m", replicas=replicas, routing=routing, refresh_s=10)


def test_routes_send_a_key_to_its_owner_s_address() -> None:
    routes = _base.DirectRoutes(listing("h:1", "h:2", "h:3"), now=0.0)
    for _ in range(50):
        key = secrets.token_urlsafe(16)
        assert routes.address_for(key, 1.0) == f"h:{_base.owner_rank(key, [0, 1, 2]) + 1}"


def test_routes_fall_back_to_the_proxy_where_they_do_not_know() -> None:
    key = secrets.token_urlsafe(16)
    assert _base.DirectRoutes(None, 0.0).address_for(key, 0.0) is None  # ListReplicas failed
    assert _base.DirectRoutes(listing(), 0.0).address_for(key, 0.0) is None  # direct ingress off
    assert _base.DirectRoutes(listing("h:1", routing="another-hash"), 0.0).address_for(key, 0.0) is None
    unknown = _base.DirectRoutes(listing("", ""), 0.0)  # ranks whose address is not published yet
    assert unknown.address_for(key, 0.0) is None


def test_a_failed_replica_goes_through_the_proxy_for_a_while_and_the_list_is_asked_again() -> None:
    routes = _base.DirectRoutes(listing("h:1"), now=0.0)
    key = secrets.token_urlsafe(16)
    assert routes.address_for(key, 1.0) == "h:1" and not routes.stale(1.0)
    routes.failed("h:1", 1.0)
    assert routes.stale(1.0)
    fresh = _base.DirectRoutes(listing("h:1"), now=2.0)  # the list still names it (not yet replaced)
    fresh.inherit(routes)
    assert fresh.address_for(key, 2.0) is None
    assert fresh.address_for(key, 1.0 + _base.AVOID_S + 0.1) == "h:1"
    assert routes.stale(10_000.0)


def test_direct_with_tls_is_refused() -> None:
    with pytest.raises(ValueError, match="plaintext"):
        Client("h:1", tls=True, direct=True)
    with pytest.raises(ValueError, match="plaintext"):
        AsyncClient("h:1", root_certificates=b"pem", direct=True)


# --------------------------------------------------------------------------- the direct server's bound


class _Core(session_pb2_grpc.SessionServiceServicer, model_pb2_grpc.ModelServiceServicer):  # type: ignore[misc]
    """A servicer core whose Generate streams one chunk, then holds until ``release`` is set:
    the calls it serves stay in flight as long as a test needs (the real ``DirectIngress`` and
    its bound run around it)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.served = 0

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.served += 1
        yield session_pb2.GenerateChunk(text="Hello")
        await self.release.wait()
        yield session_pb2.GenerateChunk(text=" world", finish_reason=common_pb2.FINISH_REASON_EOS)

    async def CreateSession(self, request: Any, context: Any) -> Any:
        return session_pb2.Session(id=f"{request.session_key}.sig", model=request.model)

    async def ListReplicas(self, request: Any, context: Any) -> Any:
        return self.listing

    async def Check(self, request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield await self.Check(request, context)

    listing = model_pb2.ListReplicasResponse()


async def _first_chunk(stub: Any, request: Any) -> Any:
    call = stub.Generate(request)
    assert (await call.read()).text == "Hello"
    return call


async def _rest(call: Any) -> list[str]:
    """The texts of a stream's remaining chunks (grpc.aio forbids mixing read() and iteration)."""
    texts = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        texts.append(chunk.text)
    return texts


def test_the_direct_server_refuses_calls_past_its_bound_with_a_reason_and_counts_them() -> None:
    async def main() -> None:
        core = _Core()
        ingress = direct_ingress.DirectIngress(core, "127.0.0.1", 0, lambda: 2)
        await ingress.start()
        try:
            async with grpc.aio.insecure_channel(ingress.address) as channel:
                stub = session_pb2_grpc.SessionServiceStub(channel)
                request = session_pb2.GenerateRequest(session_id="k.sig")
                held = [await _first_chunk(stub, request) for _ in range(2)]
                assert ingress.in_flight == 2
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(request).read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "limit of 2 calls" in str(refused.value.details())
                assert "server.direct_max_streams" in str(refused.value.details())
                reason, _, retry = rich_details(refused.value)
                assert reason == direct_ingress.FULL_REASON and retry is not None  # healthy, only full
                assert core.served == 2 and ingress.bound.refused == 1
                # Health is never refused: a probe gets its answer from a replica full of streams.
                health = health_pb2_grpc.HealthStub(channel)
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == 1
                assert [r.status async for r in health.Watch(health_pb2.HealthCheckRequest())] == [1]
                assert ingress.in_flight == 2
                held[0].cancel()  # a stream that ends frees its slot...
                for _ in range(100):
                    if ingress.in_flight == 1:
                        break
                    await asyncio.sleep(0.01)
                third = await _first_chunk(stub, request)  # ...for the next call
                core.release.set()
                for call in (held[1], third):
                    assert await _rest(call) == [" world"]
                assert ingress.in_flight == 0
        finally:
            await ingress.stop(0)

    asyncio.run(main())


def test_a_full_replica_s_turn_goes_through_the_proxy_at_once_and_the_replica_is_not_avoided() -> None:
    """``direct=True`` against a real direct server at its bound (one stream held), behind a
    proxy stand-in: the refused turn is answered through the proxy, without a pause or the 10 s
    avoidance a failed replica gets; once the replica has room, turns go direct again."""

    async def main() -> None:
        replica_core, proxy_core = _Core(), _Core()
        replica = direct_ingress.DirectIngress(replica_core, "127.0.0.1", 0, lambda: 1)
        proxy = direct_ingress.DirectIngress(proxy_core, "127.0.0.1", 0, lambda: 100)
        proxy_core.listing = listing(replica.address)
        proxy_core.release.set()
        await replica.start()
        await proxy.start()
        try:
            async with grpc.aio.insecure_channel(replica.address) as channel:
                request = session_pb2.GenerateRequest(session_id="other.sig")
                holder = await _first_chunk(session_pb2_grpc.SessionServiceStub(channel), request)
                async with AsyncClient(proxy.address, direct=True, retry_delay=5.0) as client:
                    session = await client.model("m").new_session()
                    t0 = time.monotonic()
                    chunks = [c.text async for c in session.generate([("user", "hi")])]
                    assert "".join(chunks) == "Hello world" and time.monotonic() - t0 < 2.0  # no backoff
                    assert replica.bound.refused == 1 and proxy_core.served == 1
                    routes = client._stubs.routes["m"]
                    assert routes.address_for(session.id.split(".", 1)[0], _base.now()) == replica.address
                    assert not routes.stale(_base.now())  # the list is still trusted
                    replica_core.release.set()
                    assert await _rest(holder) == [" world"]
                    chunks = [c.text async for c in session.generate([("user", "again")])]
                    assert "".join(chunks) == "Hello world"
                    assert replica_core.served == 2 and proxy_core.served == 1  # direct again
        finally:
            await replica.stop(0)
            await proxy.stop(0)

    asyncio.run(main())


def test_only_a_refusal_before_any_chunk_goes_to_the_proxy() -> None:
    full = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "full")
    gone = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    progress = _base.StreamProgress()
    assert progress.direct_refused(full) and not progress.direct_refused(gone)
    progress.delivered(Chunk(text=""))  # a chunk without text (a tool call's first delta) counts too
    assert not progress.direct_refused(full)
    assert progress.attempts == 1
