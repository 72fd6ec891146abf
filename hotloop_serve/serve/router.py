"""Session-affinity request router: every request of a session goes to the replica holding its cache.

Algorithm (rendezvous / highest-random-weight hashing over replica *ranks*):

1. The routing key is the session id's key part (``session_ids.routing_key``), read from the
   request proto: ``session_id`` for every session RPC, ``session_key`` for CreateSession.
2. Each candidate replica scores ``blake2b(key, rank)``; the tiers returned are the replicas
   in descending score, one per tier. Ray Serve tries tier by tier and skips a replica that
   is at ``max_ongoing_requests``: so the owner serves its sessions unless it is full (bounded
   load), and then the *next-ranked* replica, which is deterministic too, rebuilds the cache
   from the request's history.
3. Ranks, not replica ids: a replacement replica inherits the dead one's rank, so exactly the
   dead replica's sessions move, and move back. Adding a replica takes about 1/N of the keys
   from the others; removing one moves only its own keys.
4. Requests with no key (ListModels, health, a CreateSession without a key) go to all replicas
   in one tier: Ray picks the least loaded of two (power of two choices), spreading new work.

Every proxy and every handle computes the same ranking with no shared state. The class is
pickled by value into Ray's proxies, so it imports only the standard library, Ray and the
generated stubs.
"""

from __future__ import annotations

import hashlib
import pickle

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

_FIELDS = ("session_id", "session_key")


def request_key(pending_request: PendingRequest | None) -> str | None:
    """The session routing key of a request, or None for requests not tied to a session."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    if isinstance(arg, bytes):  # from the gRPC proxy: a pickled gRPCRequest
        try:
            arg = pickle.loads(arg).user_request_proto
        except Exception:
            return None
    arg = getattr(arg, "user_request_proto", arg)
    for name in _FIELDS:
        value = getattr(arg, name, None)
        if isinstance(value, str) and value:
            return value.split(".", 1)[0]
    return None


def replica_rank(replica: RunningReplica) -> str:
    """The replica's rank as published by the deployment (falls back to its id while unknown)."""
    meta = replica.replica_metadata
    rank = meta.get("rank") if meta else None
    return str(rank) if rank is not None else replica.replica_id.unique_id


def rendezvous_order(key: str, ranks: list[str]) -> list[int]:
    """Indexes of ``ranks`` from the key's owner to its least preferred replica."""

    def score(rank: str) -> int:
        digest = hashlib.blake2b(f"{key}\0{rank}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(range(len(ranks)), key=lambda i: score(ranks[i]), reverse=True)


class SessionAffinityRouter(RequestRouter):  # type: ignore[misc]
    """Ray Serve request router implementing the rendezvous ranking above."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        key = request_key(pending_request)
        if key is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        order = rendezvous_order(key, [replica_rank(r) for r in candidate_replicas])
        return [[candidate_replicas[i]] for i in order]

