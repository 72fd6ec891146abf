"""The bound on a replica's direct-ingress calls (``server.direct_max_streams``), on a real
two-replica synthetic app: past it, a raw stream is refused with RESOURCE_EXHAUSTED saying
which setting bounds it, and the SDK's turn for a session on that replica is answered through
the proxy, which still has room on the same replica.

Its own application (and module, so it is not running beside ``test_direct_ingress``'s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
from hotloop.v1 import common_pb2, session_pb2, session_pb2_grpc
from hotloop_client import AsyncClient, Message, Role, Settings, _base
from hotloop_client._errors import rich_details

from hotloop_serve.serve import direct_ingress

from .conftest import Server, synthetic_app
from .test_direct_ingress import list_replicas

pytestmark = pytest.mark.integration
APP = "direct-bound"
LIMIT = 2
LONG = 2000
"""Tokens of a held stream: 40 s at the 20 ms step, far longer than the test holds it."""
TOKENS = 12


@pytest.fixture(scope="module")
def bound_app(server: Server) -> Iterator[Server]:
    engine = {"synthetic_step_ms": 20, "hot_sessions": 8, "context_tokens": 32768, "session_context_tokens": 4096}
    model = {"replicas": 2, "resources": {"num_cpus": 0.25}}
    with synthetic_app(server, APP, engine, model, {"direct_ingress": True, "direct_max_streams": LIMIT}) as app:
        yield app


def test_past_the_bound_a_raw_stream_is_refused_and_the_sdk_s_turn_goes_through_the_proxy(bound_app: Server) -> None:
    listed = {r.rank: r.address for r in list_replicas(bound_app.address, APP).replicas}
    target = 0

    async def main() -> None:
        async with AsyncClient(bound_app.address, direct=True) as client:
            model = client.model(APP)
            # Sessions whose owner is rank 0 (created through the proxy, which puts each on its owner).
            owned = []
            while len(owned) < LIMIT + 2:
                session = await model.new_session(settings=Settings(temperature=0, sample_len=TOKENS))
                if _base.owner_rank(session.id.split(".", 1)[0], listed) == target:
                    owned.append(session)
                else:
                    await session.close()
            *held_sessions, raw_extra, sdk_session = owned
            async with grpc.aio.insecure_channel(listed[target]) as channel:
                stub = session_pb2_grpc.SessionServiceStub(channel)

                def turn(session_id: str) -> session_pb2.GenerateRequest:
                    return session_pb2.GenerateRequest(
                        session_id=session_id,
                        messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content="hold")],
                        settings=common_pb2.Settings(sample_len=LONG),
                    )

                held = [stub.Generate(turn(s.id)) for s in held_sessions]
                for call in held:  # each has streamed: in flight on the replica's direct server
                    assert (await call.read()).text
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(turn(raw_extra.id)).read()
                error = refused.value
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"limit of {LIMIT} calls" in str(error.details())
                assert "server.direct_max_streams" in str(error.details())
                assert rich_details(error)[0] == direct_ingress.FULL_REASON

                # The SDK's turn on the same full replica: refused directly, answered by the proxy.
                chunks = [c async for c in sdk_session.generate([Message(Role.USER, "through the proxy")])]
                final = chunks[-1]
                assert final.usage is not None and final.usage.completion_tokens == TOKENS
                assert final.served_by is not None and final.served_by.replica_rank == target
                routes = client._stubs.routes[APP]
                key = sdk_session.id.split(".", 1)[0]
                assert routes.address_for(key, _base.now()) == listed[target]  # not avoided: only full
                for call in held:
                    assert (await call.read()).text  # the held streams were never disturbed
                    call.cancel()

                # Cancelled streams free their slots: the replica takes direct calls again.
                for attempt in range(50):
                    call = stub.Generate(turn(raw_extra.id))
                    try:
                        assert (await call.read()).text
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and attempt < 49
                        await asyncio.sleep(0.1)
                    finally:
                        call.cancel()
            for session in owned:
                await session.close()

    asyncio.run(main())
