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
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hotloop.v1 import model_pb2, model_pb2_grpc, session_pb2_grpc

log = logging.getLogger(__name__)

KV_NAMESPACE = "hotloop-direct"
ROUTING = "rendezvous-blake2b-v1"
"""The hash ``router.rendezvous_order`` computes, named so an SDK can refuse one it does not know."""
REFRESH_S = 10
"""How long a client may use a list of replicas before asking again."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""As large as the requests the servicer's own size checks allow through (it checks each)."""


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


class DirectIngress:
    """The replica's own gRPC server over the servicer core ``core`` (the same object Ray's
    proxy calls: its RPC methods take ``(request, context)``, and a ``grpc.aio`` context has
    what they use of Ray's: metadata, peer, code, details, trailers)."""

    def __init__(self, core: Any, host: str, port: int) -> None:
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        session_pb2_grpc.add_SessionServiceServicer_to_server(core, self.server)
        model_pb2_grpc.add_ModelServiceServicer_to_server(core, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(core), self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise RuntimeError(f"direct ingress: cannot listen on {host}:{port}")
        self.address = f"{advertised_host(host)}:{bound}"

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
