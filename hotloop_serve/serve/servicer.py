"""The gRPC methods of a model replica: thin (proto in -> engine call -> proto out).

Ray Serve's gRPC proxy calls the ingress deployment's method named like the RPC, with the
request proto and, because the parameter is named ``grpc_context``, a context for metadata
and status. Every unary RPC goes through :func:`unary` (span, authentication, errors to
statuses by ``status.py``, cancellation re-raised); nothing here knows llama.cpp.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, NoReturn, TypeVar

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hotloop.v1 import common_pb2 as pb
from hotloop.v1 import model_pb2 as mpb
from hotloop.v1 import session_pb2 as spb

from hotloop_serve.config import Config, ModelConfig
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import StreamPacer
from hotloop_serve.errors import InvalidArgument, NotFound, ResourceExhausted
from hotloop_serve.serve import convert
from hotloop_serve.serve.auth import ANONYMOUS, Authenticator
from hotloop_serve.serve.direct_ingress import REFRESH_S as DIRECT_REFRESH_S
from hotloop_serve.serve.direct_ingress import ROUTING as DIRECT_ROUTING
from hotloop_serve.serve.fleet import Fleet, SoloFleet
from hotloop_serve.serve.openai_tools import ReplyCalls, constrain
from hotloop_serve.serve.quotas import AnonymousSessions, PendingImports, caller_key
from hotloop_serve.serve.session_ids import SessionIds, new_routing_key, routing_key
from hotloop_serve.serve.status import set_status
from hotloop_serve.serve.turns import Turn, guarded, submit
from hotloop_serve.telemetry import RpcSpan, Telemetry

_CLOSED_REMEMBERED = 4096

TRANSFER_PART_BYTES = 1 << 20
"""Largest part of an exported or imported session blob in one message (under any sane
``max_request_bytes``)."""

HEALTH_WATCHES = 2
"""``grpc.health.v1.Health/Watch`` streams one replica holds at once. Each holds one of the
replica's request slots for as long as it is open, so ``app.deployment_options`` reserves this
many slots for them, and a Watch beyond them is refused at once (RESOURCE_EXHAUSTED: poll
Check instead): health never takes the slots of model work."""

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("hotloop_caller", default="")
"""The current unary RPC's caller key (``quotas.caller_key``), set by :func:`unary`: the handlers'
signature carries the principal, and only quota checks need the address behind it."""

_Request = TypeVar("_Request", bound=Message)
_Reply = TypeVar("_Reply", bound=Message)
_Handler = Callable[["ModelServicer", _Request, str, RpcSpan], Awaitable[_Reply]]
"""A unary RPC's body: ``(self, request, principal, span) -> reply``."""
_Rpc = Callable[["ModelServicer", _Request, Any], Coroutine[Any, Any, _Reply]]
"""What Ray Serve's proxy calls: ``(self, request, grpc_context) -> reply``."""


def unary(empty: type[_Reply]) -> Callable[[_Handler[_Request, _Reply]], _Rpc[_Request, _Reply]]:
    """Make a unary RPC of ``handler`` (named like the RPC).

    The one wrapper of every unary RPC: a telemetry span named after the method, the caller
    authenticated (``principal``), and any error (a :class:`HotloopError`, or a bug) recorded
    on the gRPC context by ``status.set_status``, the one mapping, with an ``empty`` reply;
    Ray's proxy sends that status. Cancellation (``asyncio.CancelledError``, a client cancel
    or deadline) is re-raised, never reported as INTERNAL.
    """

    def decorate(handler: _Handler[_Request, _Reply]) -> _Rpc[_Request, _Reply]:
        name = handler.__name__

        # Not functools.wraps: Ray Serve reads this signature (``grpc_context`` by name),
        # not the handler's, so ``__wrapped__`` must not point at the handler.
        async def rpc(self: ModelServicer, request: _Request, grpc_context: Any = None) -> _Reply:
            try:
                with self.telemetry.rpc(name, grpc_context) as span:
                    principal = self._principal(grpc_context)
                    _CALLER.set(self._caller(principal, grpc_context))
                    return await handler(self, request, principal, span)
            except Exception as e:
                set_status(grpc_context, e)
                return empty()

        functools.update_wrapper(rpc, handler, updated=())
        del rpc.__wrapped__  # type: ignore[attr-defined]
        return rpc

    return decorate


def _stream_failed(grpc_context: Any, e: Exception) -> NoReturn:
    """gRPC's end of a failed stream (``turns.guarded``): the status recorded, then the error
    raised, since a stream's status reaches Ray's proxy only with a message or an exception:
    raising after ``set_code`` makes the proxy send our code and details."""
    set_status(grpc_context, e)
    raise e


def _metadata(grpc_context: Any) -> list[tuple[str, Any]]:
    if grpc_context is None:
        return []
    return list(grpc_context.invocation_metadata() or [])


class ModelServicer:
    """ModelService + SessionService + grpc.health.v1 for one model, over one engine.

    The core of a replica: it serves a session where the router sent it, and asks its
    ``fleet`` (``fleet.py``) only what needs the other replicas (where a new session belongs,
    a session cached elsewhere, listing, settings kept by a runner-up). Alone (tests, benches)
    that is a :class:`~hotloop_serve.serve.fleet.SoloFleet`; in Ray Serve,
    ``deployment.ModelReplica`` builds it with a ``ReplicaFleet`` and puts the HTTP API
    (``openai_http.OpenAIApi``) over the same core.
    """

    def __init__(
        self,
        config: Config,
        model: ModelConfig,
        engine: Engine,
        ids: SessionIds,
        auth: Authenticator,
        telemetry: Telemetry,
        replica_id: str = "local",
        replica_rank: int = 0,
        fleet: Fleet | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.engine = engine
        self.ids = ids
        self.auth = auth
        self.telemetry = telemetry
        self.fleet: Fleet = fleet or SoloFleet()
        self.served_by = pb.ServedBy(replica=replica_id, replica_rank=replica_rank)
        self._closed: OrderedDict[str, None] = OrderedDict()
        self.imports = PendingImports(model.limits.import_bytes_per_principal, model.limits.import_bytes_per_replica)
        self.anonymous = AnonymousSessions(model.limits.sessions_per_principal, engine.known)
        self._watches = 0
        self.pacer = StreamPacer(config.server.stream_messages_per_s)
        """Spaces this replica's Generate messages under load (its event loop only)."""

    # -- helpers -----------------------------------------------------------------------
    def _principal(self, grpc_context: Any) -> str:
        peer = grpc_context.peer() if grpc_context is not None and hasattr(grpc_context, "peer") else None
        return self.auth.principal(_metadata(grpc_context), peer)

    @staticmethod
    def _caller(principal: str, grpc_context: Any) -> str:
        """Whose quota a call counts against (``quotas.caller_key``: anonymous callers by address)."""
        peer = grpc_context.peer() if grpc_context is not None and hasattr(grpc_context, "peer") else None
        return caller_key(principal, peer)

    async def _settings(self, msg: pb.Settings, base: SamplingSettings) -> SamplingSettings:
        """``convert.settings_from_proto``, off the event loop when the settings carry a grammar
        or schema: converting and bounding a 64 KiB schema takes milliseconds this loop's other
        streams should not wait for."""
        if msg.grammar or msg.json_schema:
            return await asyncio.to_thread(convert.settings_from_proto, msg, base)
        return convert.settings_from_proto(msg, base)

    def _check_size(self, request: Message) -> None:
        size = request.ByteSize()
        if size > self.model.limits.max_request_bytes:
            raise ResourceExhausted(
                f"request is {size} bytes; this server accepts at most {self.model.limits.max_request_bytes} "
                "(limits.max_request_bytes)"
            )

    def _check_model(self, name: str) -> None:
        if name and name != self.model.name:
            served = ", ".join(m.name for m in self.config.models)
            raise NotFound(
                f"model {name!r} not found here (this endpoint serves {self.model.name!r}; "
                f"all models: {served}; pick one with the 'application' metadata)"
            )

    def _session(self, session_id: str, principal: str) -> str:
        sid = self.ids.verify(session_id, principal)
        if sid in self._closed:
            raise NotFound(f"session {session_id!r} not found (it was closed)")
        return sid

    @staticmethod
    def _tenant(principal: str, sid: str) -> str:
        """Who owns a session's cache in the engine: the principal, except for anonymous callers.

        Anonymous callers are not one tenant: each anonymous session is its own owner, so no
        prefix is shared and no quota is counted between unrelated callers, and
        ``cached_tokens`` never reveals another caller's prompt. (The session id stays signed
        for ``anonymous``, so ids keep working; listing shows an anonymous caller nothing.)
        """
        return f"{ANONYMOUS}/{routing_key(sid)}" if principal == ANONYMOUS else principal

    async def _here(self, session_id: str, principal: str) -> str:
        """A verified session id whose cache, if it exists anywhere, is on this replica now.

        A session this replica does not know may have been cached by the replica that owned
        its key before the fleet changed: ``fleet.adopt`` brings it over
        first. Not finding it anywhere is fine: the next turn rebuilds it from its history.
        """
        sid = self._session(session_id, principal)
        if not self.engine.known(sid):
            tenant = self._tenant(principal, sid)
            await self.fleet.adopt(sid, tenant)
            remembered = self.fleet.recall_settings(sid, tenant) if not self.engine.known(sid) else None
            if remembered is not None:  # its owner is gone: keep the settings its creator chose
                await asyncio.to_thread(self.engine.create_session, sid, tenant, remembered)
        return sid

    def _session_proto(self, sid: str, principal: str) -> spb.Session:
        owner = self._tenant(principal, sid)
        info = self.engine.session_info(sid, owner) if self.engine.known(sid) else None
        settings = info.settings if info else self.engine.settings_of(sid, owner)
        by = pb.ServedBy()
        by.CopyFrom(self.served_by)
        by.cache_hit = bool(info and info.context_tokens)
        return spb.Session(
            id=sid,
            model=self.model.name,
            settings=convert.settings_to_proto(settings),
            context_tokens=info.context_tokens if info else 0,
            state=info.state if info else "new",
            served_by=by,
            last_used_unix=info.last_used if info else 0.0,
        )

    # -- ModelService ------------------------------------------------------------------
    @staticmethod
    def _configured_replicas(model: ModelConfig) -> int:
        return model.autoscaling.min_replicas if model.autoscaling else model.replicas

    def model_info(self, running: dict[str, int] | None = None) -> mpb.ModelInfo:
        meta = self.engine.model.metadata
        replicas = (running or {}).get(self.model.name) or self._configured_replicas(self.model)
        return mpb.ModelInfo(
            name=self.model.name,
            architecture=meta.architecture,
            context_length=self.engine.session_context,
            train_context_length=meta.train_context_length,
            quantization=meta.quantization,
            has_chat_template=meta.chat_template is not None,
            chat_template_source=self.engine.template.origin,
            parameters=meta.parameters,
            size_bytes=meta.size_bytes,
            vocab_size=meta.vocab_size,
            replicas=replicas,
        )

    @unary(mpb.ListModelsResponse)
    async def ListModels(self, request: mpb.ListModelsRequest, principal: str, span: RpcSpan) -> mpb.ListModelsResponse:
        running = await self.fleet.running_replicas()
        models = [
            self.model_info(running)
            if m.name == self.model.name
            else mpb.ModelInfo(
                name=m.name,
                replicas=running.get(m.name) or self._configured_replicas(m),
                context_length=m.engine.session_context_tokens,
            )
            for m in self.config.models
        ]
        return mpb.ListModelsResponse(models=models)

    @unary(mpb.ModelInfo)
    async def GetModel(self, request: mpb.GetModelRequest, principal: str, span: RpcSpan) -> mpb.ModelInfo:
        self._check_model(request.model)
        return self.model_info(await self.fleet.running_replicas())

    @unary(mpb.TokenizeResponse)
    async def Tokenize(self, request: mpb.TokenizeRequest, principal: str, span: RpcSpan) -> mpb.TokenizeResponse:
        self._check_model(request.model)
        self._check_size(request)
        # Off the event loop: a 4 MiB text takes a while to tokenize, and every other RPC of
        # this replica shares the loop.
        tokens = await asyncio.to_thread(self.engine.model.tokenize, request.text, request.add_special)
        return mpb.TokenizeResponse(tokens=tokens)

    @unary(mpb.ListReplicasResponse)
    async def ListReplicas(
        self, request: mpb.ListReplicasRequest, principal: str, span: RpcSpan
    ) -> mpb.ListReplicasResponse:
        """Where each replica takes direct gRPC (none unless ``server.direct_ingress``)."""
        self._check_model(request.model)
        replicas = await self.fleet.direct_addresses() if self.config.server.direct_ingress else []
        return mpb.ListReplicasResponse(
            model=self.model.name, replicas=replicas, routing=DIRECT_ROUTING, refresh_s=DIRECT_REFRESH_S
        )

    # -- SessionService ----------------------------------------------------------------
    @unary(spb.Session)
    async def CreateSession(self, request: spb.CreateSessionRequest, principal: str, span: RpcSpan) -> spb.Session:
        self._check_model(request.model)
        await self._settings(request.settings, self.engine.defaults)  # validate before routing
        caller = _CALLER.get()
        if not request.session_key:
            # A stock client sent no routing key: pick one, then create the session on the
            # replica that will own it (the trap: settings stored here, turns served there).
            keyed = spb.CreateSessionRequest()
            keyed.CopyFrom(request)
            keyed.session_key = new_routing_key()
            session = await self.fleet.create_at_owner(keyed, principal, caller)
            if session is None:  # this replica owns the key
                session = await self.create_session_here(keyed, principal, caller)
        else:  # the router sent it to the key's owner
            session = await self.create_session_here(request, principal, caller)
        span.set_attribute("hotloop.session_id", session.id)
        return session

    async def create_session_here(
        self, request: spb.CreateSessionRequest, principal: str, caller: str = ""
    ) -> spb.Session:
        """Create a keyed session here (this replica owns the key); no auth: callers did it.
        ``caller``: whose quota it counts against (``quotas.caller_key``)."""
        settings = await self._settings(request.settings, self.engine.defaults)
        sid = self.ids.new(principal, request.session_key)
        tenant = self._tenant(principal, sid)
        if not self.engine.known(sid):
            self.anonymous.admit(caller)
        await asyncio.to_thread(self.engine.create_session, sid, tenant, settings)
        self.anonymous.add(caller, sid)
        self.fleet.settings_changed(sid, tenant, settings)
        return self._session_proto(sid, principal)

    @unary(spb.Session)
    async def GetSession(self, request: spb.GetSessionRequest, principal: str, span: RpcSpan) -> spb.Session:
        return self._session_proto(await self._here(request.session_id, principal), principal)

    @unary(spb.Session)
    async def UpdateSettings(self, request: spb.UpdateSettingsRequest, principal: str, span: RpcSpan) -> spb.Session:
        sid = await self._here(request.session_id, principal)
        settings = await self._settings(request.settings, self.engine.defaults)
        tenant = self._tenant(principal, sid)
        await asyncio.to_thread(self.engine.update_settings, sid, tenant, settings)
        self.fleet.settings_changed(sid, tenant, settings)
        return self._session_proto(sid, principal)

    @unary(spb.Session)
    async def ClearCache(self, request: spb.ClearCacheRequest, principal: str, span: RpcSpan) -> spb.Session:
        sid = await self._here(request.session_id, principal)
        if self.engine.known(sid):
            await asyncio.to_thread(self.engine.clear_cache, sid, self._tenant(principal, sid))
        return self._session_proto(sid, principal)

    @unary(spb.CloseSessionResponse)
    async def CloseSession(
        self, request: spb.CloseSessionRequest, principal: str, span: RpcSpan
    ) -> spb.CloseSessionResponse:
        sid = await self._here(request.session_id, principal)
        if self.engine.known(sid):
            await asyncio.to_thread(self.engine.close_session, sid, self._tenant(principal, sid))
        self.fleet.settings_changed(sid, self._tenant(principal, sid), None)
        self._closed[sid] = None
        while len(self._closed) > _CLOSED_REMEMBERED:
            self._closed.popitem(last=False)
        return spb.CloseSessionResponse()

    # -- session operations: fork, list, export, import --------------------------------
    @unary(spb.Session)
    async def ForkSession(self, request: spb.ForkSessionRequest, principal: str, span: RpcSpan) -> spb.Session:
        """Runs on the source's owner and forks there, under a routing key this replica owns:
        the copy is made in KV memory (``seq_cp``) and every turn of the fork comes back here."""
        self._check_size(request)
        source = await self._here(request.session_id, principal)
        self._check_cached(source, principal, request.session_id)
        keep = (
            convert.messages_from_proto(request.messages, self.model.limits.max_messages) if request.messages else None
        )
        settings = (
            await self._settings(request.settings, self.engine.settings_of(source, self._tenant(principal, source)))
            if convert.has_settings(request.settings)
            else None
        )
        caller = _CALLER.get()
        self.anonymous.admit(caller)
        sid = self.ids.new(principal, await self.fleet.colocated_key(request.session_key))
        owner, new_owner = self._tenant(principal, source), self._tenant(principal, sid)
        if owner == new_owner:
            await asyncio.to_thread(self.engine.fork_session, source, owner, sid, keep, settings)
        else:  # two anonymous tenants: a copy of the cache, never a shared one
            blob = await asyncio.to_thread(self.engine.export_session, source, owner)
            await asyncio.to_thread(self.engine.import_session, sid, new_owner, blob, settings, keep)
        self.anonymous.add(caller, sid)
        self.fleet.settings_changed(sid, new_owner, self.engine.settings_of(sid, new_owner))
        span.set_attribute("hotloop.session_id", sid)
        return self._session_proto(sid, principal)

    def _check_cached(self, sid: str, principal: str, shown: str) -> None:
        """NOT_FOUND for a session with nothing cached (never used, or cleared): there is nothing
        to fork or export, as docs/sessions.md says."""
        if not self.engine.known(sid) or not self.engine.session_info(sid, self._tenant(principal, sid)).context_tokens:
            raise NotFound(
                f"session {shown!r} has no cache on this server (it was never used)", reason="SESSION_NOT_CACHED"
            )

    @unary(spb.ListSessionsResponse)
    async def ListSessions(
        self, request: spb.ListSessionsRequest, principal: str, span: RpcSpan
    ) -> spb.ListSessionsResponse:
        self._check_model(request.model)
        if principal == ANONYMOUS:
            return spb.ListSessionsResponse()  # each anonymous session is its own tenant (_tenant)
        seen = {s.id: s for s in await self.list_sessions_here(principal)}
        for session in await self.fleet.list_peers(principal):
            seen.setdefault(session.id, session)
        sessions = list(seen.values())
        sessions.sort(key=lambda s: s.last_used_unix, reverse=True)
        return spb.ListSessionsResponse(sessions=sessions)

    async def list_sessions_here(self, principal: str) -> list[spb.Session]:
        """The caller's sessions on this replica (what a peer's ListSessions asks here too)."""
        return [self._session_proto(info.id, principal) for info in self.engine.list_sessions(principal)]

    async def ExportSession(
        self, request: spb.ExportSessionRequest, grpc_context: Any = None
    ) -> AsyncIterator[spb.ExportSessionChunk]:
        """Server-streaming: the session's blob in parts of :data:`TRANSFER_PART_BYTES`."""
        try:
            with self.telemetry.rpc("ExportSession", grpc_context) as span:
                principal = self._principal(grpc_context)
                sid = await self._here(request.session_id, principal)
                span.set_attribute("hotloop.session_id", sid)
                self._check_cached(sid, principal, request.session_id)
                blob = await asyncio.to_thread(self.engine.export_session, sid, self._tenant(principal, sid))
                for start in range(0, len(blob), TRANSFER_PART_BYTES):
                    yield spb.ExportSessionChunk(data=blob[start : start + TRANSFER_PART_BYTES], total_bytes=len(blob))
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as e:
            _stream_failed(grpc_context, e)

    @unary(spb.Session)
    async def ImportSession(self, request: spb.ImportSessionRequest, principal: str, span: RpcSpan) -> spb.Session:
        """Collect the parts of a blob (in order, one key at a time), then import it here."""
        self._check_model(request.model)
        if len(request.data) > TRANSFER_PART_BYTES:
            raise InvalidArgument(f"an import part holds at most {TRANSFER_PART_BYTES} bytes, got {len(request.data)}")
        limit = self.engine.options.evicted_bytes
        if request.total_bytes > limit:
            raise ResourceExhausted(
                f"an import holds at most {limit} bytes (engine.evicted_bytes); got {request.total_bytes}"
            )
        if not request.session_key:
            raise InvalidArgument("session_key is required: every part of one import sends the same key")
        sid = self.ids.new(principal, request.session_key)  # validates the key
        caller = _CALLER.get()
        blob = self.imports.add(
            (principal, request.session_key), caller, request.offset, request.data, request.total_bytes
        )
        if blob is None:
            return spb.Session(model=self.model.name, state="importing", context_tokens=0)
        settings = (
            await self._settings(request.settings, self.engine.defaults)
            if convert.has_settings(request.settings)
            else None
        )
        self.anonymous.admit(caller)
        tenant = self._tenant(principal, sid)
        await asyncio.to_thread(self.engine.import_session, sid, tenant, blob, settings)
        self.anonymous.add(caller, sid)
        self.fleet.settings_changed(sid, tenant, self.engine.settings_of(sid, tenant))
        span.set_attribute("hotloop.session_id", sid)
        return self._session_proto(sid, principal)

    @unary(spb.WarmupResponse)
    async def Warmup(self, request: spb.WarmupRequest, principal: str, span: RpcSpan) -> spb.WarmupResponse:
        self._check_size(request)
        sid = await self._here(request.session_id, principal)
        span.set_attribute("hotloop.session_id", sid)
        hit = self.engine.known(sid)
        messages = convert.messages_from_proto(request.messages, self.model.limits.max_messages)
        settings = await self._turn_settings(request.settings, sid, principal)
        owner = self._tenant(principal, sid)
        stream = await submit(functools.partial(self.engine.warmup, sid, owner, messages, settings))
        try:
            final = await stream.aresult()
        except asyncio.CancelledError:  # the caller left: stop prefilling for nobody
            stream.cancel()
            raise
        assert final.usage is not None
        by = pb.ServedBy()
        by.CopyFrom(self.served_by)
        by.cache_hit = hit
        self.telemetry.record_usage(span, final, "Warmup")
        return spb.WarmupResponse(
            usage=convert.usage_to_proto(final.usage),
            context_tokens=self.engine.session_info(sid, owner).context_tokens,
            served_by=by,
        )

    async def _turn_settings(self, msg: pb.Settings, sid: str, principal: str) -> SamplingSettings | None:
        if not convert.has_settings(msg):
            return None
        return await self._settings(msg, self.engine.settings_of(sid, self._tenant(principal, sid)))

    async def Generate(
        self, request: spb.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[spb.GenerateChunk]:
        """Server-streaming; an await per chunk lets a client's cancel or deadline reach us.
        Ends early through the one error path of streamed turns (``turns.guarded``)."""
        turn = Turn()
        failed = functools.partial(_stream_failed, grpc_context)
        async with contextlib.aclosing(guarded(self._generate(request, grpc_context, turn), turn, failed)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _generate(
        self, request: spb.GenerateRequest, grpc_context: Any, turn: Turn
    ) -> AsyncGenerator[spb.GenerateChunk, None]:
        with self.telemetry.rpc("Generate", grpc_context) as span:
            principal = self._principal(grpc_context)
            self._check_size(request)
            sid = await self._here(request.session_id, principal)
            span.set_attribute("hotloop.session_id", sid)
            messages = convert.messages_from_proto(request.messages, self.model.limits.max_messages)
            settings = await self._turn_settings(request.settings, sid, principal)
            tools, choice, parallel = convert.tools_from_proto(request)
            calls = None
            if tools:
                fmt = self.engine.template.tool_format
                # The tools' schemas are converted and bounded here: milliseconds, off the event loop.
                base = settings or self.engine.settings_of(sid, self._tenant(principal, sid))
                constrained = functools.partial(constrain, base, fmt, tools, choice, parallel, "tools[{}]")
                settings = await asyncio.to_thread(constrained)
                calls = ReplyCalls(fmt, tools, choice) if choice.calls and fmt else None
            t0 = time.perf_counter()
            owner = self._tenant(principal, sid)
            start = functools.partial(self.engine.generate, sid, owner, messages, settings, tools)
            turn.stream = stream = await submit(start)
            first = True
            async for chunk in stream.chunks(self.config.server.stream_coalesce_ms / 1e3, self.pacer):
                if first:
                    self.telemetry.first_token(span, time.perf_counter() - t0)
                    first = False
                if chunk.final:
                    self.telemetry.record_usage(span, chunk, "Generate")
                out = convert.chunk_to_proto(chunk, self.served_by)
                if calls is not None:  # the reply's text and its calls, apart
                    item = calls.item(chunk.text, chunk.final)
                    out.text = item["text"]
                    out.tool_calls.extend(convert.tool_calls_to_proto(item.get("tool_calls", ())))
                    if chunk.final and calls.finish_reason(chunk.finish_reason or "", "") == "tool_calls":
                        out.finish_reason = convert.FINISH_TOOL_CALLS
                yield out

    # -- grpc.health.v1 ------------------------------------------------------------------
    def serving(self) -> bool:
        """Loaded, scheduler alive, and room for one more session."""
        if not self.engine.alive:
            return False
        return self.engine.stats().sessions < self.engine.options.max_sessions

    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None) -> Any:
        known = {"", "hotloop.v1.SessionService", "hotloop.v1.ModelService"}
        if request.service not in known:
            set_status(grpc_context, NotFound(f"unknown service {request.service!r}"))
            return health_pb2.HealthCheckResponse()
        reply = health_pb2.HealthCheckResponse
        return reply(status=reply.SERVING if self.serving() else reply.NOT_SERVING)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None) -> AsyncIterator[Any]:
        """Stream the status now and whenever it changes (polled once a second); at most
        :data:`HEALTH_WATCHES` at once per replica."""
        if self._watches >= HEALTH_WATCHES:
            error = ResourceExhausted(
                f"this replica serves at most {HEALTH_WATCHES} health Watch streams at once; poll Check instead"
            )
            _stream_failed(grpc_context, error)
        self._watches += 1
        try:
            last = None
            while True:
                status = await self.Check(request, grpc_context)
                if status.status != last:
                    last = status.status
                    yield status
                await asyncio.sleep(1.0)
        finally:
            self._watches -= 1
