"""The Ray Serve deployment of one model: a replica assembles its parts and exposes them to Ray.

A replica is one engine and three parts over it, each owning its own state:

- the servicer core (``servicer.ModelServicer``): the gRPC RPCs, sessions as the engine holds
  them, closed ids, import and anonymous-session quotas;
- its fleet (``fleet.ReplicaFleet``): the other replicas: ranks and who owns a key, fetching
  and handing over sessions, settings kept for a runner-up, the fleet counters;
- the HTTP adapter (``openai_http.OpenAIApi``) over the same core: the OpenAI-compatible API,
  its conversations' sessions and the stored responses.

:class:`ModelReplica` holds only their assembly and Ray's lifecycle hooks (rank changes,
health, graceful shutdown, stats). Ray calls every other method by name (an RPC from the gRPC
proxy, a route from the HTTP proxy, a peer's call through the deployment's handle), and each
is the serving part's own method (:func:`_part`).

(No ``from __future__ import annotations`` here: FastAPI reads the route methods' annotations
through Ray's class-based view, where a string ``Request`` would not resolve; and every helper
the class uses is defined above it, which Ray ships by value.)
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from ray import serve

from hotloop_serve.config import ModelConfig, config_from_dict
from hotloop_serve.engine.persist import BlobKeys
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.synthetic import open_engine
from hotloop_serve.serve.auth import Authenticator, describe_tokens, export_secrets, load_tokens
from hotloop_serve.serve.autoscaling import DIRECT_ONGOING_METRIC
from hotloop_serve.serve.direct_ingress import DirectIngress, publish
from hotloop_serve.serve.fleet import ReplicaFleet
from hotloop_serve.serve.model_source import resolve_model_path
from hotloop_serve.serve.openai_http import OpenAIApi, api
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.session_ids import SessionIds
from hotloop_serve.telemetry import Telemetry, configure_telemetry
from hotloop_serve.telemetry.setup import shutdown_telemetry

log = logging.getLogger("ray.serve")


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


def direct_limit(configured: int | None, model: ModelConfig) -> Callable[[], int]:
    """The bound on a replica's direct calls in flight (``server.direct_max_streams``), read at
    each call: the configured number, else the replica's ``max_ongoing_requests`` as Ray holds
    it now (declarative deploys keep ``routing.max_ongoing_requests`` out of the replica's
    config and change it in place), else as this config computes it."""
    if configured is not None:
        return lambda: configured

    def ray_s() -> int:
        ctx = serve.get_replica_context()
        current = getattr(getattr(ctx, "_deployment_config", None), "max_ongoing_requests", None)
        if current:
            return int(current)
        from hotloop_serve.serve.app import max_ongoing_requests  # app imports this module

        return max_ongoing_requests(model)

    return ray_s


def _part(part: str, name: str) -> Any:
    """The method ``name`` of the replica's ``part`` (``core``, ``fleet`` or ``http``), as Ray
    finds it on the replica: Ray looks a method up by name and inspects what it gets (an async
    generator function or a coroutine function, a ``grpc_context`` parameter), so it gets the
    part's own bound method, and a stream stays that part's generator."""

    def method(self: "ModelReplica") -> Any:
        return getattr(getattr(self, part), name)

    return property(method, doc=f"``{part}.{name}``")


@serve.ingress(api)
class ModelReplica:
    """One model's replica: loads the model once, builds the core, its fleet and the HTTP
    adapter (see the module docstring), and lends Ray their methods."""

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
        rank = ctx.rank.rank if ctx.rank is not None else 0
        replica_id = ctx.replica_id.unique_id
        telemetry = Telemetry(
            mcfg.name, replica_id, engine.stats, tracer_provider, meter_provider, cfg.telemetry.request_log
        )
        self.fleet = ReplicaFleet(engine, ctx.app_name, ctx.deployment, replica_id, rank)
        self.core = ModelServicer(
            cfg,
            mcfg,
            engine,
            SessionIds(session_secret.encode(), mcfg.name),
            Authenticator(tokens, cfg.auth.anonymous),
            telemetry,
            replica_id=replica_id,
            replica_rank=rank,
            fleet=self.fleet,
        )
        self.http = OpenAIApi(self.core, ctx.app_name, ctx.deployment)
        self.direct: DirectIngress | None = None
        if cfg.server.direct_ingress:
            # Constructed on Ray's user-code event loop (running: Ray awaits __init__ there),
            # the loop every RPC of the core runs on.
            limit = direct_limit(cfg.server.direct_max_streams, mcfg)
            self.direct = DirectIngress(
                self.core, cfg.server.direct_host or cfg.server.host, cfg.server.direct_port, limit
            )
            self._direct_start = asyncio.get_running_loop().create_task(self.direct.start())
            publish(ctx.app_name, rank, self.direct.address)
        log.info(
            "hotloop replica %s (rank %d) serving %s from %s; %s",
            replica_id,
            rank,
            mcfg.name,
            mcfg.path,
            describe_tokens(tokens, cfg.auth.anonymous),
        )

    # -- gRPC: Ray's proxy calls the ingress deployment's method named like the RPC ------------
    ListModels = _part("core", "ListModels")
    GetModel = _part("core", "GetModel")
    Tokenize = _part("core", "Tokenize")
    ListReplicas = _part("core", "ListReplicas")
    CreateSession = _part("core", "CreateSession")
    GetSession = _part("core", "GetSession")
    UpdateSettings = _part("core", "UpdateSettings")
    ClearCache = _part("core", "ClearCache")
    CloseSession = _part("core", "CloseSession")
    ForkSession = _part("core", "ForkSession")
    ListSessions = _part("core", "ListSessions")
    ExportSession = _part("core", "ExportSession")
    ImportSession = _part("core", "ImportSession")
    Warmup = _part("core", "Warmup")
    Generate = _part("core", "Generate")
    Check = _part("core", "Check")
    Watch = _part("core", "Watch")

    # -- calls from peers, through the deployment's handle (``fleet.ReplicaFleet``) ------------
    create_session_here = _part("core", "create_session_here")
    list_sessions_here = _part("core", "list_sessions_here")
    give_session = _part("fleet", "give_session")
    adopt_session = _part("fleet", "adopt_session")
    remember_settings = _part("fleet", "remember_settings")
    give_responses = _part("http", "give_responses")
    adopt_responses = _part("http", "adopt_responses")

    # -- OpenAI turns handed to their conversation's owner (or to another model's app) -------
    OpenAIChat = _part("http", "OpenAIChat")
    OpenAIForward = _part("http", "OpenAIForward")
    OpenAIRespond = _part("http", "OpenAIRespond")
    OpenAIRespondForward = _part("http", "OpenAIRespondForward")
    OpenAIStored = _part("http", "OpenAIStored")

    # -- the OpenAI-compatible routes (``openai_http.OpenAIApi``) ----------------------------
    @api.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        return await self.http.list_models(request)

    @api.get("/v1/models/{name}")
    async def get_model(self, name: str, request: Request) -> Response:
        return await self.http.get_model(name, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.http.chat_completions(request)

    @api.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await self.http.create_response(request)

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        return await self.http.get_response(response_id, request)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self.http.delete_response(response_id, request)

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request) -> Response:
        return await self.http.response_input_items(response_id, request)

    # -- Ray's hooks ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The engine's counters and the fleet's (for operators' scripts, `status`, leak checks)."""
        engine = self.core.engine
        probe = engine.grammars.counters
        return {
            **dataclasses.asdict(engine.stats()),
            **self.fleet.counters,
            "rank": self.fleet.rank,
            **process_facts(),
            "grammar_checks": probe["checks"],
            "grammar_refused": probe["refused"],
            "grammar_child_restarts": probe["child_restarts"],
            "import_bytes_pending": self.core.imports.held(),
            "direct_in_flight": self.direct.in_flight if self.direct is not None else 0,
            "direct_refused": self.direct.bound.refused if self.direct is not None else 0,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Ray for autoscaled deployments: the direct calls in flight, which Ray's own
        count of ongoing requests never sees; ``autoscaling.direct_aware_policy`` adds them."""
        return {DIRECT_ONGOING_METRIC: float(self.direct.in_flight) if self.direct is not None else 0.0}

    def record_replica_metadata(self) -> dict[str, Any]:
        """Published to the routers once, at start: the rank is what session affinity hashes on."""
        return {"rank": self.fleet.rank}

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray and handed to the routers: the current rank (it may be reassigned)."""
        return {"rank": self.fleet.rank}

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Ray's hook; with a ``rank`` parameter it also reports rank reassignments (after a
        downscale), which this replica then serves under and publishes."""
        if rank is not None and getattr(rank, "rank", None) is not None:
            self.fleet.renumbered(int(rank.rank))
            self.core.served_by.replica_rank = self.fleet.rank
            if self.direct is not None:
                publish(self.fleet.app, self.fleet.rank, self.direct.address)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine died."""
        if not self.core.engine.alive:
            raise RuntimeError("the engine's scheduler thread is not running")

    async def __del__(self) -> None:
        """Ray's graceful shutdown (after in-flight requests drained): hand sessions over, then
        stop the engine (which snapshots what is left to the disk tier, if configured)."""
        core = getattr(self, "core", None)
        direct = getattr(self, "direct", None)
        if direct is not None:  # Ray drained its own requests, not these: give them the same grace
            await direct.stop(core.model.graceful_shutdown_timeout_s * 0.3 if core is not None else 1.0)
        if core is not None:
            engine = core.engine
            if core.model.handover and engine.alive:
                budget = core.model.graceful_shutdown_timeout_s * 0.6
                try:  # stored responses first: their records may be the only copy, sessions are caches
                    t0 = time.monotonic()
                    sent = await self.http.hand_over_responses(budget / 2) if await self.fleet.others_running() else 0
                    moved = await self.fleet.hand_over(budget - (time.monotonic() - t0))
                    log.info("handed %d stored responses and %d sessions over to their next owners", sent, moved)
                except Exception:
                    log.exception("session hand-over failed")
            await asyncio.to_thread(engine.close)
        shutdown_telemetry()


ModelDeployment = serve.deployment(ModelReplica)
