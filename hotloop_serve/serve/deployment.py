"""The Ray Serve deployment of one model: a replica = one engine + the gRPC servicer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from hotloop.v1 import session_pb2 as spb
from ray import serve

from hotloop_serve.config import config_from_dict
from hotloop_serve.engine.persist import BlobKeys
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.synthetic import open_engine
from hotloop_serve.errors import HotloopError
from hotloop_serve.serve.auth import Authenticator, describe_tokens, export_secrets, load_tokens
from hotloop_serve.serve.handle_calls import as_own_request
from hotloop_serve.serve.model_source import resolve_model_path
from hotloop_serve.serve.router import peer_address, rendezvous_order
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.session_ids import SessionIds, new_routing_key, routing_key
from hotloop_serve.serve.settings_memo import SettingsMemo
from hotloop_serve.telemetry import Telemetry, configure_telemetry
from hotloop_serve.telemetry.setup import shutdown_telemetry

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


def _running_by_app() -> dict[str, int]:
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


def _runner_up(key: str, ranks: list[str], owner: str) -> int:
    """Index in ``ranks`` of the replica that takes ``key``'s sessions when ``owner`` is gone."""
    others = [r for r in ranks if r != owner]
    return ranks.index(others[rendezvous_order(key, others)[0]])


def _steer(key: str) -> spb.ImportSessionRequest:
    """The first argument of a handle call: the router reads ``key`` from it."""
    return spb.ImportSessionRequest(session_key=key)


def _key_owned_by(index: int, ranks: list[str]) -> str:
    """A routing key whose owner among ``ranks`` is ``ranks[index]`` (steers a handle call there)."""
    while True:
        key = new_routing_key()
        if rendezvous_order(key, ranks)[0] == index:
            return key


def process_facts() -> dict[str, int]:
    """This replica process's id, resident memory and OS threads (Linux ``/proc``; zeros elsewhere):
    what a leak check or a crash hunt reads (a restarted replica has a new pid)."""
    facts = {"pid": os.getpid(), "rss_bytes": 0, "os_threads": 0}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                facts["rss_bytes"] = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                facts["os_threads"] = int(line.split()[1])
    return facts


class ModelReplica(ModelServicer):
    """Loads the model once per replica; its methods are the RPCs (see ModelServicer)."""

    def __init__(self, config: dict[str, Any], model: str, session_secret: str) -> None:
        cfg = config_from_dict(config)
        mcfg = cfg.model(model)
        tokens = load_tokens(cfg.auth)  # fails closed (a configured source with no token), before loading
        tracer_provider, meter_provider = configure_telemetry(cfg.telemetry.enabled, cfg.telemetry.console)
        defaults = SamplingSettings().merged(**mcfg.default_settings())
        engine = open_engine(
            str(resolve_model_path(mcfg.path)),
            mcfg.engine,
            default_settings=defaults,
            chat_template=mcfg.chat_template,
            sessions_per_owner=mcfg.limits.sessions_per_principal,
            max_sample_len=mcfg.limits.max_sample_len,
            blob_keys=BlobKeys.derived(export_secrets(cfg.auth, session_secret)),
            prestart_grammar_probe=True,
        )
        ctx = serve.get_replica_context()
        self._app, self._deployment = ctx.app_name, ctx.deployment
        self._rank = ctx.rank.rank if ctx.rank is not None else 0
        replica_id = ctx.replica_id.unique_id
        telemetry = Telemetry(
            mcfg.name, replica_id, engine.stats, tracer_provider, meter_provider, cfg.telemetry.request_log
        )
        self.fleet = {
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
        super().__init__(
            cfg,
            mcfg,
            engine,
            SessionIds(session_secret.encode(), mcfg.name),
            Authenticator(tokens, cfg.auth.anonymous),
            telemetry,
            replica_id=replica_id,
            replica_rank=self._rank,
        )
        log.info(
            "hotloop replica %s (rank %d) serving %s from %s; %s",
            replica_id,
            self._rank,
            mcfg.name,
            mcfg.path,
            describe_tokens(tokens, cfg.auth.anonymous),
        )

    async def route_create(self, request: spb.CreateSessionRequest, principal: str, caller: str) -> spb.Session:
        """To the key's owner through our own deployment's handle (the affinity router picks it),
        or directly when the owner is this replica: a handle call from a replica to itself lost
        its reply now and then in Ray 2.60 (the callee logged OK; the caller waited until the
        client's deadline), which made keyless CreateSession calls time out."""
        ranks = await self._ranks()
        if ranks[rendezvous_order(routing_key(request.session_key), ranks)[0]] == str(self._rank):
            return await self.CreateSessionFor(request, principal, caller)
        handle = serve.get_deployment_handle(self._deployment, self._app)
        result: spb.Session = await as_own_request(lambda: handle.CreateSessionFor.remote(request, principal, caller))
        return result

    async def _ranks(self) -> list[str]:
        """The ranks the routers hash on now (0..N-1 for N running replicas), once they settle."""
        ranks = [str(r) for r in range(max(1, await asyncio.to_thread(self._running_replicas), self._rank + 1))]
        if ranks != self._fleet_seen[0]:
            self._fleet_seen = (ranks, time.monotonic())
        return ranks

    def _settling(self) -> bool:
        return time.monotonic() - self._fleet_seen[1] < SETTLING_S

    async def colocated_key(self, preferred: str) -> str:
        """A routing key this replica owns (a fork then stays next to its source's cache)."""
        ranks = await self._ranks()
        mine = ranks.index(str(self._rank))
        if preferred and rendezvous_order(preferred, ranks)[0] == mine:
            return preferred
        return _key_owned_by(mine, ranks)

    async def route_list(self, principal: str) -> list[spb.Session]:
        """This replica's sessions, and every other replica's: one call per peer (a call to
        itself through the handle is not made)."""
        handle = serve.get_deployment_handle(self._deployment, self._app)

        async def list_at(peer: str) -> list[spb.Session]:
            try:
                call = as_own_request(lambda: handle.ListFor.remote(_steer(peer), principal))
                listed: list[spb.Session] = await asyncio.wait_for(call, LIST_TIMEOUT_S)
                return listed
            except Exception as e:  # a peer this replica's router cannot reach: list the others
                log.warning("listing sessions: peer %s did not answer: %r", peer, e)
                return []

        calls = [list_at(peer) for peer in await self._peers()]
        seen = {s.id: s for s in await self.ListFor(spb.ImportSessionRequest(), principal)}
        for sessions in await asyncio.gather(*calls):
            for session in sessions:
                seen.setdefault(session.id, session)
        return list(seen.values())

    async def _peers(self) -> list[str]:
        """Routing keys addressing each other running replica (:func:`router.peer_address`)."""
        others = max(await asyncio.to_thread(self._running_replicas), 1) - 1
        return [peer_address(i, self.served_by.replica) for i in range(others)]

    async def running_replicas(self) -> dict[str, int]:
        """Serve's count of RUNNING replicas of every app (a model's app is named after it)."""
        try:
            return await asyncio.to_thread(_running_by_app)
        except Exception:  # the controller is unreachable: the configured counts stand
            return {}

    def _running_replicas(self) -> int:
        try:
            return _running_by_app().get(self._app, 1)
        except Exception:  # the controller is unreachable: this replica's own answer is better than none
            return 1

    def stats(self) -> dict[str, Any]:
        """The engine's counters and the fleet's (for operators' scripts, `status`, leak checks)."""
        probe = self.engine.grammars.counters
        return {
            **dataclasses.asdict(self.engine.stats()),
            **self.fleet,
            "rank": self._rank,
            **process_facts(),
            "grammar_checks": probe["checks"],
            "grammar_refused": probe["refused"],
            "grammar_child_restarts": probe["child_restarts"],
            "import_bytes_pending": self.imports.held(),
        }

    def record_replica_metadata(self) -> dict[str, Any]:
        """Published to the routers once, at start: the rank is what session affinity hashes on."""
        return {"rank": self._rank}

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray and handed to the routers: the current rank (it may be reassigned)."""
        return {"rank": self._rank}

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Ray's hook; with a ``rank`` parameter it also reports rank reassignments (after a
        downscale), which this replica then serves under and publishes."""
        if rank is not None and getattr(rank, "rank", None) is not None:
            if int(rank.rank) != self._rank:
                self._fleet_seen = ([], time.monotonic())
            self._rank = int(rank.rank)
            self.served_by.replica_rank = self._rank

    def check_health(self) -> None:
        """Ray restarts a replica whose engine died."""
        if not self.engine.alive:
            raise RuntimeError("the engine's scheduler thread is not running")

    # -- the fleet: sessions move with their caches -------------------------------------
    # A replica that leaves (scale-in, rolling upgrade, graceful stop) hands each cached
    # session to the replica that owns its key once it is gone (``hand_over``, from Ray's
    # graceful shutdown); a replica that joins fetches a session it now owns from the replica
    # that owned it before, on first use (``adopt_from_previous_owner``). Either way a transfer
    # that fails or times out only means the next turn re-prefills: never an error, never a
    # wrong cache (the blob carries the model fingerprint; ids are bound to their principal).

    async def AdoptSession(self, target: spb.ImportSessionRequest, principal: str, sid: str, blob: bytes) -> bool:
        """Take a session handed over by a leaving replica (``target`` steers the router here);
        a copy already here wins only if it is busy or at least as long."""
        try:
            if not await asyncio.to_thread(self.engine.adopt_session, sid, principal, blob):
                return False
        except HotloopError as e:
            log.warning("refused a handed-over session: %s", e.message)
            return False
        self.fleet["adopted"] += 1
        return True

    async def GiveSession(
        self, target: spb.ImportSessionRequest, principal: str, sid: str
    ) -> bytes | SamplingSettings | None:
        """Give a session to its new owner (and forget it here): its cache as a blob, else the
        settings its owner left here (:meth:`RememberSettings`), else None."""
        blob = None
        if self.engine.known(sid):
            try:
                blob = await asyncio.to_thread(self.engine.release_session, sid, principal)
            except HotloopError:
                blob = None
        if blob is not None:
            self.fleet["given"] += 1
            return blob
        return self.recall_settings(sid, principal)

    async def RememberSettings(
        self, target: spb.ImportSessionRequest, principal: str, sid: str, settings: SamplingSettings | None
    ) -> None:
        """Keep a session's settings for its owner, whose runner-up this replica is (None: forget)."""
        self._memo.set(sid, principal, settings)

    def recall_settings(self, sid: str, principal: str) -> SamplingSettings | None:
        remembered = self._memo.get(sid, principal)
        if remembered is not None:
            self.fleet["settings_recalled"] += 1
        return remembered

    def settings_changed(self, sid: str, principal: str, settings: SamplingSettings | None) -> None:
        task = asyncio.get_running_loop().create_task(self._tell_runner_up(sid, principal, settings))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tell_runner_up(self, sid: str, principal: str, settings: SamplingSettings | None) -> None:
        """The owner sends the change to its runner-up; a runner-up holding the session (its
        owner is down) keeps it itself, for the owner's replacement to fetch."""
        ranks = await self._ranks()
        if len(ranks) < 2:
            return
        key, mine = routing_key(sid), str(self._rank)
        owner = ranks[rendezvous_order(key, ranks)[0]]
        runner_up = _runner_up(key, ranks, owner)
        if ranks[runner_up] == mine:
            self._memo.set(sid, principal, settings)
            return
        if owner != mine:
            return  # a spilled call on a third replica: the owner and its runner-up know better
        handle = serve.get_deployment_handle(self._deployment, self._app)
        try:
            probe = _steer(_key_owned_by(runner_up, ranks))
            call = as_own_request(lambda: handle.RememberSettings.remote(probe, principal, sid, settings))
            await asyncio.wait_for(call, TRANSFER_TIMEOUT_S)
            self.fleet["settings_sent"] += 1
        except Exception as e:  # the runner-up is busy or gone: only a hard loss of this owner would need it
            self.fleet["settings_send_failures"] += 1
            log.info("could not send session %s's settings to rank %s: %r", sid[:12], ranks[runner_up], e)

    async def adopt_from_previous_owner(self, sid: str, principal: str) -> None:
        """Fetch a session this replica now owns from whichever peer holds it. Usually that is
        the runner-up of the ranking (the owner before this replica joined), but Ray renumbers
        ranks after a downscale and during a roll, routers learn new ranks only at their next
        poll, and a leaving replica hands over by the ranks of its moment: so every peer is
        asked at once (one short call each, only on a session's first turn on a new owner),
        and the longest copy given wins."""
        ranks = await self._ranks()
        owner = ranks[rendezvous_order(routing_key(sid), ranks)[0]] == str(self._rank)
        if len(ranks) < 2 or not (owner or self._settling()):
            return  # one replica, or a turn spilled here from a busy owner: the history rebuilds it
        peers = await self._peers()
        given = await self._ask_to_give(sid, principal, peers)
        if given is None:
            self.fleet["fetch_misses"] += 1
            log.info("no cache of session %s on %d peers (ranks %s, rank %s): rebuilt from its history",
                     sid[:12], len(peers), ranks, self._rank)  # fmt: skip
        try:
            if isinstance(given, bytes):
                await asyncio.to_thread(self.engine.import_session, sid, principal, given)
                self.fleet["fetched"] += 1
            elif isinstance(given, SamplingSettings):  # no cache anywhere, but the settings survived
                await asyncio.to_thread(self.engine.create_session, sid, principal, given)
                self.settings_changed(sid, principal, given)
        except HotloopError as e:  # a foreign or damaged copy: the history rebuilds the cache
            self.fleet["fetch_failures"] += 1
            log.info("could not adopt session %s: %s", sid[:12], e.message)

    async def _ask_to_give(self, sid: str, principal: str, peers: list[str]) -> bytes | SamplingSettings | None:
        """``GiveSession`` on each of ``peers`` at once: the largest cache given (the longest
        history: a stale copy of a spilled turn is smaller), else settings, else None."""
        if not peers:
            return None
        handle = serve.get_deployment_handle(self._deployment, self._app)

        async def ask(peer: str) -> bytes | SamplingSettings | None:
            try:
                call = as_own_request(lambda: handle.GiveSession.remote(_steer(peer), principal, sid))
                given: bytes | SamplingSettings | None = await asyncio.wait_for(call, TRANSFER_TIMEOUT_S)
                return given
            except Exception as e:  # gone or slow: the history rebuilds the cache
                self.fleet["fetch_failures"] += 1
                log.info("could not fetch session %s from peer %s: %r", sid[:12], peer, e)
                return None

        answers = await asyncio.gather(*(ask(p) for p in peers))
        blobs = [a for a in answers if isinstance(a, bytes)]
        if blobs:
            return max(blobs, key=len)
        return next((a for a in answers if a is not None), None)

    async def hand_over(self, budget_s: float) -> int:
        """Send every cached session to its next owner, most recently used first, within ``budget_s``.

        Nothing is sent when no replica of the model runs any more (the app is being deleted),
        and sending stops after two transfers in a row time out (nobody takes them): a deleted
        app then stops in a second instead of 3 s per session."""
        deadline = time.monotonic() + budget_s
        if not await asyncio.to_thread(self._running_replicas):
            return 0
        handle = serve.get_deployment_handle(self._deployment, self._app)
        moved = timeouts = 0
        for info in self.engine.list_sessions(None):
            left = deadline - time.monotonic()
            if left <= 0 or timeouts >= 2:
                break
            if not info.context_tokens:
                continue
            try:
                blob = await asyncio.to_thread(self.engine.export_session, info.id, info.owner)
                target = spb.ImportSessionRequest(session_key=routing_key(info.id))
                call = handle.AdoptSession.remote(target, info.owner, info.id, blob)
                moved += bool(await asyncio.wait_for(call, min(left, TRANSFER_TIMEOUT_S)))
                timeouts = 0
            except TimeoutError:
                timeouts += 1
                log.info("hand-over of session %s timed out", info.id[:12])
            except Exception as e:
                log.info("hand-over of session %s failed: %r", info.id[:12], e)
        self.fleet["handed_over"] += moved
        return moved

    async def __del__(self) -> None:
        """Ray's graceful shutdown (after in-flight requests drained): hand sessions over, then
        stop the engine (which snapshots what is left to the disk tier, if configured)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            if self.model.handover and engine.alive:
                budget = self.model.graceful_shutdown_timeout_s * 0.6
                try:
                    moved = await self.hand_over(budget)
                    log.info("handed %d sessions over to their next owners", moved)
                except Exception:
                    log.exception("session hand-over failed")
            await asyncio.to_thread(engine.close)
        shutdown_telemetry()


ModelDeployment = serve.deployment(ModelReplica)
