"""Direct ingress: a replica's own gRPC server beside Ray's proxy (``server.direct_ingress``).

Through Ray Serve every streamed message is pickled by the replica, sent to the proxy as a Ray
object, unpickled and sent again: about half a millisecond of CPU per message on our machines
(``bench/serving.py``), which caps an accelerator replica's token rate at the proxy. Here the
replica serves the same servicer core on a plain ``grpc.aio`` server: a message costs what
gRPC costs. Clients find the servers through ``ModelService.ListReplicas`` (answered by any
replica, through the proxy) and send a session's turns to its owner, hashing its routing key
over the ranks exactly as the session-affinity router does (``router.owner_of``), so a direct
turn lands where a proxied one would, and a client that is wrong (a stale list) only costs the
session a move (the servicer adopts it, as after any fleet change).

Addresses are published in Ray's internal key-value store under the replica's rank: a rank's
new holder (a replacement, a renumbering) overwrites it, so the list of ranks 0..N-1 is current
once the fleet settles; a client reaching a dead address gets UNAVAILABLE and falls back to
the proxy.

Direct calls skip Ray's request accounting, so this server keeps its own (:class:`CallBound`):
at most ``server.direct_max_streams`` calls in flight (the replica's ``max_ongoing_requests`` by
default), the next refused with RESOURCE_EXHAUSTED (reason :data:`FULL_REASON`), which the SDKs
answer by sending that turn through the proxy; and the number in flight is what the replica
reports to the autoscaler (``autoscaling.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hotloop.v1 import model_pb2, model_pb2_grpc, session_pb2_grpc

from hotloop_serve.errors import ResourceExhausted
from hotloop_serve.serve.status import DETAILS_KEY, rich_status

log = logging.getLogger(__name__)

KV_NAMESPACE = "hotloop-direct"
ROUTING = "rendezvous-blake2b-v1"
"""The hash ``router.rendezvous_order`` computes, named so an SDK can refuse one it does not know."""
REFRESH_S = 10
"""How long a client may use a list of replicas before asking again."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""As large as the requests the servicer's own size checks allow through (it checks each)."""
FULL_REASON = "DIRECT_INGRESS_FULL"
"""``ErrorInfo.reason`` of a call refused because the replica's direct ingress is at its bound."""
FULL_RETRY_S = 1.0
"""``RetryInfo`` of that refusal: the replica is healthy, only full (an SDK that predates the
bound retries through the proxy; the current ones go there at once)."""
UNBOUNDED_PREFIX = "/grpc.health.v1.Health/"
"""Calls the bound leaves alone: health (the servicer caps Watch streams itself, and a probe
must get an answer from a replica busy with streams)."""


def kv_key(app: str, rank: int) -> bytes:
    return f"{app}/{rank}".encode()


def advertised_host(host: str) -> str:
    """What clients dial: the bind address, unless it is a wildcard (a pod binds 0.0.0.0): then
    the Ray node's IP, which in Kubernetes is the pod's."""
    if host in ("0.0.0.0", "::", ""):
        try:
            import ray

            return str(ray.util.get_node_ip_address())
        except Exception:
            return socket.gethostbyname(socket.gethostname())
    return host


class CallBound(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """At most ``limit()`` calls in flight on the direct server (health apart), counted from the
    handler's start to its end (a stream: until its last chunk, cancel or error).

    Not ``grpc.aio.server(maximum_concurrent_rpcs=...)``: that one counts health Check and
    Watch calls too (a probe would be refused by a replica busy with streams, or a few Watch
    streams would take stream slots), refuses with a bare "Concurrent RPC limit exceeded!" that
    neither a person nor an SDK can tell from other exhaustion, is fixed when the server is
    built (``limit`` is read at each call, so it follows an in-place change of Ray's
    ``max_ongoing_requests``), and keeps no count the autoscaler could read.
    """

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.in_flight = 0
        """Calls being served now (what ``record_autoscaling_stats`` reports)."""
        self.refused = 0
        """Calls refused since start (``ModelReplica.stats``)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or str(handler_call_details.method).startswith(UNBOUNDED_PREFIX):
            return handler
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        behavior = getattr(handler, kind)
        streams = handler.response_streaming and inspect.isasyncgenfunction(behavior)
        wrapped = self._bounded_stream(behavior) if streams else self._bounded_call(behavior)
        return handler._replace(**{kind: wrapped})

    async def _admit(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Count the call in, or refuse it (``context.abort`` raises) with a status a person can
        act on and the rich details the SDKs read."""
        limit = self.limit()
        if self.in_flight < limit:
            self.in_flight += 1
            return
        self.refused += 1
        error = ResourceExhausted(
            f"this replica's direct ingress is serving its limit of {limit} calls at once "
            "(server.direct_max_streams, default the replica's max_ongoing_requests); send the call "
            "through the proxy (the SDKs do so themselves for that turn), or raise the limit or add replicas",
            reason=FULL_REASON,
            retry_after_s=FULL_RETRY_S,
        )
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        details = rich_status(error, code, error.message).SerializeToString()
        await context.abort(code, error.message, trailing_metadata=((DETAILS_KEY, details),))

    def _bounded_call(self, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await self._admit(context)
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                self.in_flight -= 1

        return call

    def _bounded_stream(self, behavior: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await self._admit(context)
            try:
                # Closed here, not when collected: an early end (the caller's cancel) reaches the
                # core's stream at once, which cancels its engine request.
                async with contextlib.aclosing(behavior(request, context)) as items:
                    async for item in items:
                        yield item
            finally:
                self.in_flight -= 1

        return stream


class DirectIngress:
    """The replica's own gRPC server over the servicer core ``core`` (the same object Ray's
    proxy calls: its RPC methods take ``(request, context)``, and a ``grpc.aio`` context has
    what they use of Ray's: metadata, peer, code, details, trailers), with at most ``limit()``
    calls in flight (:class:`CallBound`)."""

    def __init__(self, core: Any, host: str, port: int, limit: Callable[[], int]) -> None:
        self.bound = CallBound(limit)
        self.server = grpc.aio.server(
            interceptors=[self.bound],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        session_pb2_grpc.add_SessionServiceServicer_to_server(core, self.server)
        model_pb2_grpc.add_ModelServiceServicer_to_server(core, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(core), self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise RuntimeError(f"direct ingress: cannot listen on {host}:{port}")
        self.address = f"{advertised_host(host)}:{bound}"

    @property
    def in_flight(self) -> int:
        """Direct calls being served now (health apart)."""
        return self.bound.in_flight

    async def start(self) -> None:
        await self.server.start()
        log.info("direct ingress: gRPC on %s", self.address)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


class _Health:
    """grpc.health.v1 over the core's Check and Watch, with the ``List`` newer stubs expect."""

    SERVICES = ("", "hotloop.v1.SessionService", "hotloop.v1.ModelService")

    def __init__(self, core: Any) -> None:
        self.Check = core.Check
        self.Watch = core.Watch

    async def List(self, request: Any, context: Any) -> Any:
        statuses = {
            name: await self.Check(health_pb2.HealthCheckRequest(service=name), context) for name in self.SERVICES
        }
        return health_pb2.HealthListResponse(statuses=statuses)


def publish(app: str, rank: int, address: str) -> None:
    """Record that ``rank`` of ``app`` takes direct gRPC at ``address`` (overwrites the rank's
    previous holder's entry). Never fails the replica: unpublished, it is reached through the proxy."""
    from ray.experimental import internal_kv

    value = json.dumps({"address": address}).encode()
    try:
        internal_kv._internal_kv_put(kv_key(app, rank), value, overwrite=True, namespace=KV_NAMESPACE)
    except Exception:  # no list entry only means clients reach this replica through the proxy
        log.exception("direct ingress: could not publish %s for rank %d", address, rank)


def published(app: str, ranks: int) -> list[model_pb2.ReplicaAddress]:
    """Ranks 0..``ranks``-1 of ``app`` with the address each published ('' where none yet)."""
    from ray.experimental import internal_kv

    out = []
    for rank in range(ranks):
        raw = internal_kv._internal_kv_get(kv_key(app, rank), namespace=KV_NAMESPACE)
        address = json.loads(raw)["address"] if raw else ""
        out.append(model_pb2.ReplicaAddress(rank=rank, address=address))
    return out
