"""A replica's view of its model's other replicas: which one owns a key, and moving sessions.

The servicer core (``servicer.ModelServicer``) serves a session where the router sent it; it
asks its fleet only what needs the other replicas:

- where a keyed CreateSession belongs (:meth:`Fleet.create_at_owner`), and a key this replica
  owns, for a fork to stay next to its source (:meth:`Fleet.colocated_key`);
- the caller's sessions on the other replicas (:meth:`Fleet.list_peers`);
- a session this replica does not hold yet, fetched from whichever peer does
  (:meth:`Fleet.adopt`), and the settings a session's owner left with its runner-up
  (:meth:`Fleet.recall_settings`, :meth:`Fleet.settings_changed`);
- how many replicas of each model run (:meth:`Fleet.running_replicas`).

:class:`SoloFleet` is a replica alone (unit tests, benches, the servicer in-process): it owns
every key and has no peer. :class:`ReplicaFleet` is a Ray Serve replica among its peers: it
reaches them through the deployment's own handle, and serves their calls (``give_session``,
``adopt_session``, ``remember_settings``), which ``deployment.ModelReplica`` exposes under the
same names. A peer is addressed by a routing key passed as the handle's ``session_id``: a
session's key reaches its owner, ``router.peer_address`` one given peer; the arguments carry
only what the call is about.

Moving sessions: a replica that leaves (scale-in, rolling upgrade, graceful stop) hands each
cached session to the replica that owns its key once it is gone (:meth:`ReplicaFleet.hand_over`,
from Ray's graceful shutdown); a replica that joins fetches a session it now owns from the
replica that owned it before, on first use (:meth:`ReplicaFleet.adopt`). Either way a transfer
that fails or times out only means the next turn re-prefills: never an error, never a wrong
cache (the blob carries the model fingerprint; ids are bound to their principal).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from hotloop.v1 import model_pb2 as mpb
from hotloop.v1 import session_pb2 as spb
from ray import serve

from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import HotloopError
from hotloop_serve.serve.direct_ingress import published
from hotloop_serve.serve.handle_calls import as_own_request
from hotloop_serve.serve.router import owner_of, peer_address, runner_up_of
from hotloop_serve.serve.session_ids import new_routing_key, routing_key
from hotloop_serve.serve.settings_memo import SettingsMemo

log = logging.getLogger("ray.serve")

TRANSFER_TIMEOUT_S = 3.0
"""Longest wait for one session's transfer between replicas; past it the cache is rebuilt."""
LIST_TIMEOUT_S = 10.0
"""How long ListSessions waits for each peer: Ray 2.60's handle router in a replica can miss a
replacement replica for good (its long poll delivered one update, then none); a listing
without that peer beats a DEADLINE_EXCEEDED."""
SETTLING_S = 30.0
"""After a change of the fleet as this replica sees it (its start, a renumbering, a replica
count change), routers may still hash on other ranks than this replica computes (they poll
the replicas' ranks); meanwhile a replica fetches every session it is asked about and does
not hold, owner by its own reckoning or not."""

Given = bytes | SamplingSettings | None
"""What a peer gives for a session: its cache as a blob, else the settings its owner left, else nothing."""


class Fleet(Protocol):
    """What the servicer core asks of the other replicas (see the module docstring)."""

    async def owns(self, key: str) -> bool:
        """Whether this replica is ``key``'s owner by its own reckoning: a turn it plans for that
        key is then served here, not through a handle call to itself."""

    async def create_at_owner(
        self, request: spb.CreateSessionRequest, principal: str, caller: str
    ) -> spb.Session | None:
        """Create the keyed session on its owner when that is another replica; None: it is this one."""

    async def colocated_key(self, preferred: str) -> str:
        """A routing key this replica owns: ``preferred`` if it does, else a new one."""

    async def list_peers(self, principal: str) -> list[spb.Session]:
        """The caller's sessions on every other replica (a peer that does not answer is left out)."""

    async def adopt(self, sid: str, tenant: str) -> None:
        """Bring a session this replica does not hold from the peer that does, if any."""

    def recall_settings(self, sid: str, tenant: str) -> SamplingSettings | None:
        """Settings a session's owner left here for it, this replica being its runner-up."""

    def settings_changed(self, sid: str, tenant: str, settings: SamplingSettings | None) -> None:
        """A session's settings were set here (None: it was closed): its runner-up is told."""

    async def running_replicas(self) -> dict[str, int]:
        """Replicas running now, by model (empty: not known)."""

    async def direct_addresses(self) -> list[mpb.ReplicaAddress]:
        """Each running replica's direct-ingress address by rank (``direct_ingress.py``)."""

    async def peers(self) -> list[str]:
        """Routing keys addressing each other running replica of this model (none: alone)."""


class SoloFleet:
    """A replica alone: every key is its own, no peer holds anything, nothing to tell."""

    direct_address = ""
    """Its own direct-ingress address, if it has one."""

    async def owns(self, key: str) -> bool:
        return True

    async def create_at_owner(
        self, request: spb.CreateSessionRequest, principal: str, caller: str
    ) -> spb.Session | None:
        return None

    async def colocated_key(self, preferred: str) -> str:
        return preferred or new_routing_key()

    async def list_peers(self, principal: str) -> list[spb.Session]:
        return []

    async def adopt(self, sid: str, tenant: str) -> None:
        return None

    def recall_settings(self, sid: str, tenant: str) -> SamplingSettings | None:
        return None

    def settings_changed(self, sid: str, tenant: str, settings: SamplingSettings | None) -> None:
        return None

    async def running_replicas(self) -> dict[str, int]:
        return {}

    async def direct_addresses(self) -> list[mpb.ReplicaAddress]:
        return [mpb.ReplicaAddress(rank=0, address=self.direct_address)] if self.direct_address else []

    async def peers(self) -> list[str]:
        return []


def running_by_app() -> dict[str, int]:
    """RUNNING replicas of every Serve app, from the controller (each app has one deployment)."""
    return {
        name: sum(
            n
            for d in app.deployments.values()
            for state, n in d.replica_states.items()
            if str(state).endswith("RUNNING")
        )
        for name, app in serve.status().applications.items()
    }


def key_owned_by(index: int, ranks: list[str]) -> str:
    """A routing key whose owner among ``ranks`` is ``ranks[index]`` (reaches that replica)."""
    while True:
        key = new_routing_key()
        if owner_of(key, ranks) == index:
            return key


class ReplicaFleet:
    """A Ray Serve replica among its peers (see the module docstring).

    ``rank`` is the rank the routers hash this replica on (Ray may reassign it: :meth:`renumbered`).
    """

    def __init__(
        self,
        engine: Engine,
        app: str,
        deployment: str,
        replica_id: str,
        rank: int,
    ) -> None:
        self.engine = engine
        self.app, self.deployment, self.replica_id, self.rank = app, deployment, replica_id, rank
        self.counters = {
            "handed_over": 0,
            "adopted": 0,
            "fetched": 0,
            "given": 0,
            "fetch_failures": 0,
            "fetch_misses": 0,
            "settings_sent": 0,
            "settings_send_failures": 0,
            "settings_recalled": 0,
        }
        self._memo = SettingsMemo()
        self._fleet_seen: tuple[list[str], float] = ([], time.monotonic())
        self._background: set[asyncio.Task[None]] = set()

    def _handle(self, key: str) -> Any:
        """This model's deployment, routed to ``key``'s owner (or the peer ``key`` addresses)."""
        return serve.get_deployment_handle(self.deployment, self.app).options(session_id=key)

    def renumbered(self, rank: int) -> None:
        """Ray reassigned this replica's rank: ownership is reckoned afresh (settling again)."""
        if rank != self.rank:
            self._fleet_seen = ([], time.monotonic())
        self.rank = rank

    # -- who owns what ---------------------------------------------------------------------
    async def ranks(self) -> list[str]:
        """The ranks the routers hash on now, once they settle: 0..N-1 for the N running
        replicas (Ray numbers them so; the routers read each replica's published rank)."""
        ranks = [str(r) for r in range(max(1, await asyncio.to_thread(self._running_replicas), self.rank + 1))]
        if ranks != self._fleet_seen[0]:
            self._fleet_seen = (ranks, time.monotonic())
        return ranks

    def _settling(self) -> bool:
        return time.monotonic() - self._fleet_seen[1] < SETTLING_S

    def _running_replicas(self) -> int:
        try:
            return running_by_app().get(self.app, 1)
        except Exception:  # the controller is unreachable: this replica's own answer is better than none
            return 1

    async def running_replicas(self) -> dict[str, int]:
        """Serve's count of RUNNING replicas of every app (a model's app is named after it)."""
        try:
            return await asyncio.to_thread(running_by_app)
        except Exception:  # the controller is unreachable: the configured counts stand
            return {}

    async def direct_addresses(self) -> list[mpb.ReplicaAddress]:
        return await asyncio.to_thread(published, self.app, len(await self.ranks()))

    async def _peers(self) -> list[str]:
        """Routing keys addressing each other running replica (:func:`router.peer_address`)."""
        others = max(await asyncio.to_thread(self._running_replicas), 1) - 1
        return [peer_address(i, self.replica_id) for i in range(others)]

    async def peers(self) -> list[str]:
        return await self._peers()

    async def others_running(self) -> bool:
        """Whether any replica of this model still runs (none: its app is being deleted, and
        there is nobody to hand anything to)."""
        return bool(await asyncio.to_thread(self._running_replicas))

    async def owns(self, key: str) -> bool:
        ranks = await self.ranks()
        return ranks[owner_of(key, ranks)] == str(self.rank)

    # -- what the servicer core asks -------------------------------------------------------
    async def create_at_owner(
        self, request: spb.CreateSessionRequest, principal: str, caller: str
    ) -> spb.Session | None:
        """To the key's owner through the deployment's handle (the affinity router picks it by
        the request's ``session_key``); None when the owner is this replica (the core creates it
        directly): a handle call from a replica to itself lost its reply now and then in Ray
        2.60 (the callee logged OK; the caller waited until the client's deadline), which made
        keyless CreateSession calls time out."""
        if await self.owns(routing_key(request.session_key)):
            return None
        handle = self._handle(routing_key(request.session_key))
        result: spb.Session = await as_own_request(
            lambda: handle.create_session_here.remote(request, principal, caller)
        )
        return result

    async def colocated_key(self, preferred: str) -> str:
        """A routing key this replica owns (a fork then stays next to its source's cache)."""
        ranks = await self.ranks()
        mine = ranks.index(str(self.rank))
        if preferred and owner_of(preferred, ranks) == mine:
            return preferred
        return key_owned_by(mine, ranks)

    async def list_peers(self, principal: str) -> list[spb.Session]:
        """Every other replica's sessions of ``principal``: one call per peer, at once."""

        async def list_at(peer: str) -> list[spb.Session]:
            try:
                call = as_own_request(lambda: self._handle(peer).list_sessions_here.remote(principal))
                listed: list[spb.Session] = await asyncio.wait_for(call, LIST_TIMEOUT_S)
                return listed
            except Exception as e:  # a peer this replica's router cannot reach: list the others
                log.warning("listing sessions: peer %s did not answer: %r", peer, e)
                return []

        listed: list[spb.Session] = []
        for sessions in await asyncio.gather(*(list_at(peer) for peer in await self._peers())):
            listed.extend(sessions)
        return listed

    def recall_settings(self, sid: str, tenant: str) -> SamplingSettings | None:
        remembered = self._memo.get(sid, tenant)
        if remembered is not None:
            self.counters["settings_recalled"] += 1
        return remembered

    def settings_changed(self, sid: str, tenant: str, settings: SamplingSettings | None) -> None:
        task = asyncio.get_running_loop().create_task(self._tell_runner_up(sid, tenant, settings))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tell_runner_up(self, sid: str, tenant: str, settings: SamplingSettings | None) -> None:
        """The owner sends the change to its runner-up; a runner-up holding the session (its
        owner is down) keeps it itself, for the owner's replacement to fetch."""
        ranks = await self.ranks()
        if len(ranks) < 2:
            return
        key, mine = routing_key(sid), str(self.rank)
        owner = ranks[owner_of(key, ranks)]
        runner_up = runner_up_of(key, ranks, owner)
        if ranks[runner_up] == mine:
            self._memo.set(sid, tenant, settings)
            return
        if owner != mine:
            return  # a spilled call on a third replica: the owner and its runner-up know better
        try:
            handle = self._handle(key_owned_by(runner_up, ranks))
            call = as_own_request(lambda: handle.remember_settings.remote(tenant, sid, settings))
            await asyncio.wait_for(call, TRANSFER_TIMEOUT_S)
            self.counters["settings_sent"] += 1
        except Exception as e:  # the runner-up is busy or gone: only a hard loss of this owner would need it
            self.counters["settings_send_failures"] += 1
            log.info("could not send session %s's settings to rank %s: %r", sid[:12], ranks[runner_up], e)

    async def adopt(self, sid: str, tenant: str) -> None:
        """Fetch a session this replica now owns from whichever peer holds it. Usually that is
        the runner-up of the ranking (the owner before this replica joined), but Ray renumbers
        ranks after a downscale and during a roll, routers learn new ranks only at their next
        poll, and a leaving replica hands over by the ranks of its moment: so every peer is
        asked at once (one short call each, only on a session's first turn on a new owner),
        and the longest copy given wins."""
        ranks = await self.ranks()
        owner = ranks[owner_of(routing_key(sid), ranks)] == str(self.rank)
        if len(ranks) < 2 or not (owner or self._settling()):
            return  # one replica, or a turn spilled here from a busy owner: the history rebuilds it
        peers = await self._peers()
        given = await self._ask_to_give(sid, tenant, peers)
        if given is None:
            self.counters["fetch_misses"] += 1
            log.info("no cache of session %s on %d peers (ranks %s, rank %s): rebuilt from its history",
                     sid[:12], len(peers), ranks, self.rank)  # fmt: skip
        try:
            if isinstance(given, bytes):
                await asyncio.to_thread(self.engine.import_session, sid, tenant, given)
                self.counters["fetched"] += 1
            elif isinstance(given, SamplingSettings):  # no cache anywhere, but the settings survived
                await asyncio.to_thread(self.engine.create_session, sid, tenant, given)
                self.settings_changed(sid, tenant, given)
        except HotloopError as e:  # a foreign or damaged copy: the history rebuilds the cache
            self.counters["fetch_failures"] += 1
            log.info("could not adopt session %s: %s", sid[:12], e.message)

    async def _ask_to_give(self, sid: str, tenant: str, peers: list[str]) -> Given:
        """``give_session`` on each of ``peers`` at once: the largest cache given (the longest
        history: a stale copy of a spilled turn is smaller), else settings, else None."""
        if not peers:
            return None

        async def ask(peer: str) -> Given:
            try:
                call = as_own_request(lambda: self._handle(peer).give_session.remote(tenant, sid))
                given: Given = await asyncio.wait_for(call, TRANSFER_TIMEOUT_S)
                return given
            except Exception as e:  # gone or slow: the history rebuilds the cache
                self.counters["fetch_failures"] += 1
                log.info("could not fetch session %s from peer %s: %r", sid[:12], peer, e)
                return None

        answers = await asyncio.gather(*(ask(p) for p in peers))
        blobs = [a for a in answers if isinstance(a, bytes)]
        if blobs:
            return max(blobs, key=len)
        return next((a for a in answers if a is not None), None)

    # -- what peers ask of this replica ----------------------------------------------------
    async def give_session(self, tenant: str, sid: str) -> Given:
        """Give a session to its new owner (and forget it here): its cache as a blob, else the
        settings its owner left here (:meth:`remember_settings`), else None."""
        blob = None
        if self.engine.known(sid):
            try:
                blob = await asyncio.to_thread(self.engine.release_session, sid, tenant)
            except HotloopError:
                blob = None
        if blob is not None:
            self.counters["given"] += 1
            return blob
        return self.recall_settings(sid, tenant)

    async def adopt_session(self, tenant: str, sid: str, blob: bytes) -> bool:
        """Take a session handed over by a leaving replica; a copy already here wins only if it
        is busy or at least as long."""
        try:
            if not await asyncio.to_thread(self.engine.adopt_session, sid, tenant, blob):
                return False
        except HotloopError as e:
            log.warning("refused a handed-over session: %s", e.message)
            return False
        self.counters["adopted"] += 1
        return True

    async def remember_settings(self, tenant: str, sid: str, settings: SamplingSettings | None) -> None:
        """Keep a session's settings for its owner, whose runner-up this replica is (None: forget)."""
        self._memo.set(sid, tenant, settings)

    # -- leaving ---------------------------------------------------------------------------
    async def hand_over(self, budget_s: float) -> int:
        """Send every cached session to its next owner, most recently used first, within ``budget_s``.

        Nothing is sent when no replica of the model runs any more (the app is being deleted),
        and sending stops after two transfers in a row time out (nobody takes them): a deleted
        app then stops in a second instead of 3 s per session."""
        deadline = time.monotonic() + budget_s
        if not await asyncio.to_thread(self._running_replicas):
            return 0
        moved = timeouts = 0
        for info in self.engine.list_sessions(None):
            left = deadline - time.monotonic()
            if left <= 0 or timeouts >= 2:
                break
            if not info.context_tokens:
                continue
            try:
                blob = await asyncio.to_thread(self.engine.export_session, info.id, info.owner)
                call = self._handle(routing_key(info.id)).adopt_session.remote(info.owner, info.id, blob)
                moved += bool(await asyncio.wait_for(call, min(left, TRANSFER_TIMEOUT_S)))
                timeouts = 0
            except TimeoutError:
                timeouts += 1
                log.info("hand-over of session %s timed out", info.id[:12])
            except Exception as e:
                log.info("hand-over of session %s failed: %r", info.id[:12], e)
        self.counters["handed_over"] += moved
        return moved
