"""The SDK's direct routing (``direct=True``) agrees with the server's router, and falls back to
the proxy where it does not know better."""

from __future__ import annotations

import secrets

import pytest
from hotloop.v1 import model_pb2
from hotloop_client import AsyncClient, Client, _base

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
