"""Session-affinity request router: every request of a session goes to the replica holding its cache.

Algorithm (rendezvous / highest-random-weight hashing over replica *ranks*):

1. The routing key is the session id's key part (``session_ids.routing_key``). The SDKs send
   it as the ``session_id`` gRPC metadata, which Ray's proxy hands to the router, so nothing
   is decoded; from a stock client it is read from the request proto (``session_id`` for
   every session RPC, ``session_key`` for CreateSession), only for requests up to
   :data:`MAX_DECODED_BYTES` (a 4 MiB history is not unpickled to find a key).
2. Each candidate replica scores ``blake2b(key, rank)``; the tiers are the replicas in
   descending score, one per tier. Ray Serve tries tier by tier and skips a replica that is at
   ``max_ongoing_requests``. Only Generate gets every tier: it carries the whole history, so
   when the owner is full the *next-ranked* replica (deterministic too) rebuilds the cache from
   it. Every other session RPC gets its owner alone (a control RPC on another replica would
   act on nothing there: clear no cache, report 0 tokens, create a shadow session), and waits
   for a slot or fails; ``app.max_ongoing_requests`` keeps slots free for them.
3. Ranks, not replica ids: a replacement replica inherits the dead one's rank, so exactly the
   dead replica's sessions move, and move back. Adding a replica takes about 1/N of the keys
   from the others; removing one moves only its own keys. A rank Ray reassigns after a
   downscale reaches the routers through the replica's routing stats; two replicas claiming
   one rank meanwhile are told apart deterministically (:func:`replica_names`).
4. Requests with no key (ListModels, health, a CreateSession without a key) go to all replicas
   in one tier: Ray picks the least loaded of two (power of two choices), spreading new work.
5. A key ``@<i>/<replica id>`` (:func:`peer_address`) addresses the i-th of the *other*
   replicas, ordered by replica id: a replica reaches each of its peers so (fetching a
   session after a fleet change, listing), whatever ranks they are hashed on at that moment
   (Ray renumbers ranks after a downscale, and routers learn it only at their next poll). An
   index past the peers the router knows wraps around (asking a peer twice is harmless); with
   no peer known yet it is waited for (Ray retries, backing off) until the caller gives up. It
   never lands on the caller itself.

Every proxy and every handle computes the same ranking with no shared state. The class is
pickled by value into Ray's proxies, so it imports only the standard library, Ray and the
generated stubs.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from time import monotonic

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

_FIELDS = ("session_id", "session_key")
MAX_DECODED_BYTES = 64 * 1024
"""Largest proxied request the router unpickles to find a key the caller did not send as
metadata; a larger one from a stock client is routed as keyless (Generate rebuilds the cache)."""
SPILLS = frozenset({"Generate", "OpenAIChat"})
"""The calls that may run on a replica other than the session's owner (each carries the whole
history: the next-ranked replica rebuilds the cache from it)."""


UNAVAILABLE_HOLD_S = 10.0
"""How long a replica whose call failed as unavailable is ranked last (until it answers a probe
again, or the controller drops it): the next-ranked replica serves its sessions meanwhile."""

PEER = "@"
"""Prefix of a key that names a peer replica instead of a session (no session key has it)."""


def peer_address(index: int, caller: str) -> str:
    """The routing key of the ``index``-th replica other than ``caller`` (a replica id), in
    replica-id order: the same replica in every router that knows the same replicas."""
    return f"{PEER}{index}/{caller}"


def _peer(key: str, candidates: list[RunningReplica]) -> list[RunningReplica]:
    index, _, caller = key[len(PEER) :].partition("/")
    others = sorted(
        (r for r in candidates if str(r.replica_id.unique_id) != caller), key=lambda r: str(r.replica_id.unique_id)
    )
    if not others or not index.isdigit():
        return []
    return [others[int(index) % len(others)]]


def _metadata_key(pending_request: PendingRequest) -> str | None:
    """The key the SDKs send as ``session_id`` metadata (Ray's proxy passes it to the router)."""
    metadata = getattr(pending_request, "metadata", None)
    value = getattr(metadata, "session_id", None)
    if isinstance(value, str) and value:
        return value.split(".", 1)[0]
    return None


def request_key(pending_request: PendingRequest | None) -> str | None:
    """The session routing key of a request, or None for requests not tied to a session."""
    if pending_request is None:
        return None
    key = _metadata_key(pending_request)
    if key is not None or not pending_request.args:
        return key
    arg = pending_request.args[0]
    if isinstance(arg, bytes):  # from the gRPC proxy: a pickled gRPCRequest
        if len(arg) > MAX_DECODED_BYTES:
            return None
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
    """The replica's rank as it publishes it (falls back to its id while unknown).

    Its routing stats (polled by Ray) win over its metadata (captured once at start): after a
    downscale Ray may reassign ranks, and tells the replica through ``reconfigure``.
    """
    for published in (replica.routing_stats, replica.replica_metadata):
        rank = published.get("rank") if published else None
        if rank is not None:
            return str(rank)
    return str(replica.replica_id.unique_id)


def replica_names(replicas: list[RunningReplica]) -> list[str]:
    """What each candidate is hashed as: its rank, never the same for two replicas.

    While a reassignment is being reported, two replicas may claim one rank: the one with the
    smaller replica id keeps it and the other is hashed on its id, the same way in every router.
    """
    names = [replica_rank(r) for r in replicas]
    holder: dict[str, int] = {}
    for i in sorted(range(len(replicas)), key=lambda i: str(replicas[i].replica_id.unique_id)):
        holder.setdefault(names[i], i)
    return [name if holder[name] == i else str(replicas[i].replica_id.unique_id) for i, name in enumerate(names)]


def rendezvous_order(key: str, ranks: list[str]) -> list[int]:
    """Indexes of ``ranks`` from the key's owner to its least preferred replica."""

    def score(rank: str) -> int:
        digest = hashlib.blake2b(f"{key}\0{rank}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(range(len(ranks)), key=lambda i: score(ranks[i]), reverse=True)


def owner_of(key: str, ranks: list[str]) -> int:
    """Index in ``ranks`` of ``key``'s owner: the head of :func:`rendezvous_order`, which the
    router's first tier is too. A replica that reckons an owner itself (``fleet.ReplicaFleet``)
    asks this, so the two can only differ in the ranks they see, never in the computation."""
    return rendezvous_order(key, ranks)[0]


def runner_up_of(key: str, ranks: list[str], owner: str) -> int:
    """Index in ``ranks`` of the replica that takes ``key``'s sessions when ``owner`` is gone
    (the owner of ``key`` among the others)."""
    others = [r for r in ranks if r != owner]
    return ranks.index(others[owner_of(key, others)])


class SessionAffinityRouter(RequestRouter):  # type: ignore[misc]
    """Ray Serve request router implementing the rendezvous ranking above.

    A replica Ray reports unavailable (a call or a probe failed: it died and the controller has
    not said so yet, or the network dropped it) ranks last for :data:`UNAVAILABLE_HOLD_S`, so a
    session's next call goes to its runner-up at once. Ray drops a replica it knows to be dead
    by itself (ActorDiedError), but a call through the gRPC transport only learns UNAVAILABLE,
    and would otherwise be sent to the dead owner again until the controller removes it.
    """

    _unavailable: dict[str, float] | None = None
    clock: Callable[[], float] = staticmethod(monotonic)

    def _unavailable_now(self) -> frozenset[str]:
        if not self._unavailable:
            return frozenset()
        now = self.clock()
        self._unavailable = {r: t for r, t in self._unavailable.items() if t > now}
        return frozenset(self._unavailable)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        if self._unavailable is None:
            self._unavailable = {}
        self._unavailable[str(replica_id.unique_id)] = self.clock() + UNAVAILABLE_HOLD_S

    def on_new_queue_len_info(self, replica_id: ReplicaID, num_ongoing_requests: int) -> None:
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        if self._unavailable:  # it answered: available again
            self._unavailable.pop(str(replica_id.unique_id), None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Ray's retry loop sleeps between rounds only when told to: without this, a request
            # waiting for a full owner or for a peer that does not exist spins a core (and the
            # GIL of the proxy or replica it runs in) until it is routed.
            pending_request.routing_context.should_backoff = True
            if pending_request.future.done() and candidate_replicas:
                # Cancelled (its caller timed out): any tier makes Ray's loop see that and stop;
                # a peer lookup with no peer would otherwise be retried for ever.
                return [candidate_replicas]
        key = request_key(pending_request)
        if key is not None and key.startswith(PEER):
            return [_peer(key, candidate_replicas)]
        if key is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        order = rendezvous_order(key, replica_names(candidate_replicas))
        down = self._unavailable_now()
        if down:  # a stable sort: the available ones keep their order, the others go last
            order.sort(key=lambda i: str(candidate_replicas[i].replica_id.unique_id) in down)
        tiers = [[candidate_replicas[i]] for i in order]
        method = getattr(getattr(pending_request, "metadata", None), "call_method", "")
        return tiers if method in SPILLS else tiers[:1]
