"""The clients: ``Client`` -> ``Model`` -> ``Session``, and their asyncio twins.

``_async_client.py`` (on ``grpc.aio``) is the one written by hand. ``scripts/gen_sync_client.py``
generates the blocking ``_client.py`` from it with unasync (``async`` and ``await`` dropped,
``AsyncClient`` -> ``Client``, ``asyncio`` -> ``time``, ``open_aio_channel`` ->
``open_channel``...), and ``make lint`` fails when ``_client.py`` is stale. Everything that is
not I/O (requests, metadata, retry rules, conversions) lives in ``_base.py``. Docstrings are
shared by both clients.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from types import TracebackType
from typing import Any

import grpc
from hotloop.v1 import model_pb2_grpc, serve_proxy_pb2, session_pb2, session_pb2_grpc

from . import _base
from ._base import HistoryLike
from ._errors import HotloopError, NotFound, from_rpc_error
from ._types import Chunk, ModelInfo, SessionInfo, Settings, Tool, Usage


class _Stubs:
    """The channel and its stubs, made on first use (an asyncio channel belongs to the event
    loop it was created on, so it must be made inside it)."""

    def __init__(self, base: _base.BaseClient) -> None:
        self.channel: Any = _base.open_aio_channel(base)
        self.sessions = session_pb2_grpc.SessionServiceStub(self.channel)
        self.models = model_pb2_grpc.ModelServiceStub(self.channel)
        self.list_applications = self.channel.unary_unary(
            _base.LIST_APPLICATIONS_METHOD,
            request_serializer=serve_proxy_pb2.ListApplicationsRequest.SerializeToString,
            response_deserializer=_base.decode_application_names,
        )
        self.routes: dict[str, _base.DirectRoutes] = {}
        """By model, with ``direct=True``."""
        self.replicas: dict[str, tuple[Any, Any]] = {}
        """By direct address: its channel and SessionService stub."""
        self._base = base

    def replica(self, address: str) -> Any:
        """The SessionService stub of a replica's own server (its channel opened on first use)."""
        if address not in self.replicas:
            channel = _base.open_aio_channel(self._base, address)
            self.replicas[address] = (channel, session_pb2_grpc.SessionServiceStub(channel))
        return self.replicas[address][1]


class AsyncClient:
    """A connection to a hotloop-serve deployment (Ray Serve's gRPC proxy).

    ``address`` is ``host:port``. ``token`` is sent as ``authorization: Bearer``; ``tls`` or
    ``root_certificates`` (PEM bytes) switch to TLS. ``timeout`` is the default deadline, in
    seconds, of every call, including a whole streamed reply; each method's ``timeout=``
    overrides it, and a unary call with neither gets 30 s. A failover (a replica or the proxy
    restarting) is retried up to five times, after ``retry_delay`` seconds, then doubling,
    jittered. Use as a context manager (``with Client(...)``, ``async with AsyncClient(...)``),
    or call :meth:`close`. The channel opens on the first call (so an ``AsyncClient`` may be
    constructed outside the event loop); after :meth:`close`, a further call opens a new one.

    ``direct=True`` (servers with ``server.direct_ingress``, plaintext inside the cluster):
    each session's turns (``generate``) go straight to the replica holding its cache, found
    through ``ListReplicas`` and the router's own hash, skipping Ray's proxy and most of its
    per-message CPU; everything else, and any turn whose replica is unknown or just failed,
    goes through the proxy as usual.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        retry_delay: float = 0.2,
        options: Sequence[tuple[str, Any]] = (),
        direct: bool = False,
    ) -> None:
        self._base = _base.BaseClient(
            address,
            token=token,
            tls=tls,
            root_certificates=root_certificates,
            timeout=timeout,
            retry_delay=retry_delay,
            options=options,
            direct=direct,
        )
        self._lazy: _Stubs | None = None

    @property
    def _stubs(self) -> _Stubs:
        if self._lazy is None:
            self._lazy = _Stubs(self._base)
        return self._lazy

    # -- plumbing ---------------------------------------------------------------------

    async def _unary(
        self,
        method: Callable[..., Any],
        request: Any,
        application: str | None,
        timeout: float | None,
        session_key: str | None = None,
    ) -> Any:
        """One unary call, retried with backoff after a failover, errors translated."""
        deadline = self._base.deadline(timeout, unary=True)
        attempt = 1
        while True:
            try:
                metadata = self._base.metadata(application, session_key)
                return await method(request, metadata=metadata, timeout=deadline.remaining())
            except grpc.RpcError as exc:
                if not _base.should_retry_unary(exc, attempt):
                    raise from_rpc_error(exc) from exc
            await asyncio.sleep(self._base.backoff(attempt))
            attempt += 1

    async def _generate_stub(self, model: str, key: str) -> tuple[Any, str | None]:
        """Where a session's turn goes: with ``direct``, the stub of the replica owning its key
        and that replica's address (:class:`_base.DirectRoutes`); else, or where unknown, the
        proxy's stub and None."""
        stubs = self._stubs
        if not self._base.direct:
            return stubs.sessions, None
        now = _base.now()
        routes = stubs.routes.get(model)
        if routes is None or routes.stale(now):
            try:
                response = await stubs.models.ListReplicas(
                    _base.list_replicas_request(model),
                    metadata=self._base.metadata(model),
                    timeout=_base.DEFAULT_UNARY_TIMEOUT_S,
                )
            except grpc.RpcError:  # an older server (UNIMPLEMENTED), or none reachable: the proxy for now
                response = None
            fresh = _base.DirectRoutes(response, _base.now())
            if routes is not None:
                fresh.inherit(routes)
            stubs.routes[model] = routes = fresh
        address = routes.address_for(key, _base.now())
        if address is None:
            return stubs.sessions, None
        return stubs.replica(address), address

    def _direct_failed(self, model: str, address: str | None) -> None:
        routes = self._stubs.routes.get(model)
        if address is not None and routes is not None:
            routes.failed(address, _base.now())

    # -- public API -------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._base.address

    async def application_names(self, *, timeout: float | None = None) -> list[str]:
        """The Ray Serve applications behind the proxy (one per served model)."""
        request = serve_proxy_pb2.ListApplicationsRequest()
        names: list[str] = await self._unary(self._stubs.list_applications, request, None, timeout)
        return names

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """Every model the server serves.

        No model name is known yet, so the proxy's own ListApplications names an app to
        route ListModels to. A server that is not behind Ray Serve (UNIMPLEMENTED) is asked
        directly.
        """
        application: str | None = None
        try:
            names = await self.application_names(timeout=timeout)
        except HotloopError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
        else:
            if not names:
                return []
            application = names[0]
        response = await self._unary(self._stubs.models.ListModels, _base.list_models_request(), application, timeout)
        return [_base.model_info_from_proto(m) for m in response.models]

    def model(self, name: str) -> AsyncModel:
        """A handle on one served model (no call is made until you use it)."""
        return AsyncModel(self, name)

    async def close(self) -> None:
        """Close the channel; sessions are not closed on the server (they expire there)."""
        if self._lazy is not None:
            await self._lazy.channel.close()
            for channel, _ in self._lazy.replicas.values():
                await channel.close()
            self._lazy = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._base.describe()}>"


class AsyncModel:
    """One served model; every call it makes is routed to the Ray Serve app of that name."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        if not name:
            raise ValueError("model name is empty")
        self._client = client
        self.name = name

    async def info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model's architecture, context length, quantization, replicas (GetModel)."""
        client = self._client
        pb = await client._unary(client._stubs.models.GetModel, _base.get_model_request(self.name), self.name, timeout)
        return _base.model_info_from_proto(pb)

    async def tokenize(self, text: str, *, add_special: bool = False, timeout: float | None = None) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        client = self._client
        request = _base.tokenize_request(self.name, text, add_special)
        pb = await client._unary(client._stubs.models.Tokenize, request, self.name, timeout)
        return list(pb.tokens)

    async def new_session(self, settings: Settings | None = None, *, timeout: float | None = None) -> AsyncSession:
        """Create a session (a conversation whose KV cache stays hot between turns)."""
        client = self._client
        settings = settings or Settings()
        request = _base.create_session_request(self.name, settings, _base.new_session_key())
        pb = await client._unary(client._stubs.sessions.CreateSession, request, self.name, timeout, request.session_key)
        state = _base.SessionState(id=pb.id, model=self.name, settings=settings)
        state.apply(pb, settings)
        return AsyncSession(client, state)

    async def list_sessions(self, *, timeout: float | None = None) -> list[SessionInfo]:
        """Your sessions of this model on every replica, most recently used first."""
        client = self._client
        request = session_pb2.ListSessionsRequest(model=self.name)
        pb = await client._unary(client._stubs.sessions.ListSessions, request, self.name, timeout)
        return [_base.session_info_from_proto(s) for s in pb.sessions]

    async def import_session(
        self, data: bytes, settings: Settings | None = None, *, timeout: float | None = None
    ) -> AsyncSession:
        """A new session from :meth:`AsyncSession.export`'s bytes (from this server or another of
        the same model); its next turn reuses the imported cache."""
        client = self._client
        key = _base.new_session_key()
        pb = None
        for request in _base.import_requests(self.name, key, data, settings):
            pb = await client._unary(client._stubs.sessions.ImportSession, request, self.name, timeout, key)
        assert pb is not None
        state = _base.SessionState(id=pb.id, model=self.name, settings=settings or Settings())
        state.apply(pb, settings or Settings())
        return AsyncSession(client, state)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} at {self._client.address}>"


class AsyncSession:
    """A conversation on the server. You keep the history and send all of it each turn;
    the session only makes follow-up turns fast by keeping its KV cache. Use as a context
    manager to close it."""

    def __init__(self, client: AsyncClient, state: _base.SessionState) -> None:
        self._client = client
        self._state = state

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str:
        return self._state.model

    @property
    def settings(self) -> Settings:
        """The settings sent with every request of this session."""
        return self._state.settings

    async def _call(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        return await self._client._unary(method, request, self._state.model, timeout, self._state.key)

    def generate(
        self,
        history: HistoryLike,
        *,
        timeout: float | None = None,
        tools: Sequence[Tool] = (),
        tool_choice: str = "",
        parallel_tool_calls: bool | None = None,
        **overrides: Any,
    ) -> AsyncGenerator[Chunk, None]:
        """Stream the reply to ``history`` (``Message``s or ``(role, content)`` pairs).

        ``tools`` offers functions to call: ``tool_choice`` is ``"auto"`` (the default with
        tools), ``"none"``, ``"required"`` or a tool's name; the reply's calls arrive as
        ``Chunk.tool_calls`` (``assistant_message`` joins a reply into the message to append,
        then one ``Role.TOOL`` message per result).
        Keyword ``overrides`` (e.g. ``temperature=0``) apply to this turn only. If the
        replica fails before any text arrived the request is re-sent (with backoff); after text
        arrived, :class:`TurnInterrupted` carries the partial text. Leaving the loop early
        (``break``, closing the generator, Ctrl-C, cancelling the task iterating it) cancels
        the call on the server.
        """
        request = self._state.generate_request(history, overrides, tools, tool_choice, parallel_tool_calls)
        return self._stream(request, timeout)

    async def _stream(self, request: Any, timeout: float | None) -> AsyncGenerator[Chunk, None]:
        client = self._client
        deadline = client._base.deadline(timeout)
        progress = _base.StreamProgress()
        metadata = client._base.metadata(self._state.model, self._state.key)
        proxy = False  # True once this turn's replica refused it directly (full): the proxy's now
        while True:
            if proxy:
                stub, direct = client._stubs.sessions, None
            else:
                stub, direct = await client._generate_stub(self._state.model, self._state.key)
            call = stub.Generate(request, metadata=metadata, timeout=deadline.remaining())
            try:
                async for pb in call:
                    chunk = _base.chunk_from_proto(pb)
                    progress.delivered(chunk)
                    yield chunk
                return
            except grpc.RpcError as exc:
                if direct is not None and progress.direct_refused(exc):
                    proxy = True
                    continue  # no pause: the proxy has the replica's other slots
                if _base.retriable(exc):
                    client._direct_failed(self._state.model, direct)
                if not progress.should_retry(exc):
                    raise progress.error(exc) from exc
            finally:
                # No-op once the call finished; otherwise (break, close, cancel, error) it
                # frees the server's slot at once instead of generating into the void.
                call.cancel()
            await asyncio.sleep(client._base.backoff(progress.attempts - 1))

    def regenerate(
        self, history: HistoryLike, *, timeout: float | None = None, **overrides: Any
    ) -> AsyncGenerator[Chunk, None]:
        """Stream a new version of ``history``'s last reply (it must end with an assistant message).

        The client owns the history: rewinding is sending a shorter or edited one. The server
        reuses the cache up to the first token that differs (see :func:`with_message_replaced`).
        """
        return self.generate(_base.without_last_reply(history), timeout=timeout, **overrides)

    async def fork(
        self, history: HistoryLike | None = None, settings: Settings | None = None, *, timeout: float | None = None
    ) -> AsyncSession:
        """A new session starting with this one's cache: all of it, or only up to ``history`` (a
        prefix of this session's conversation). Copied in the server's KV cache, not prefilled
        again; settings default to this session's."""
        client = self._client
        settings = settings or self._state.settings
        request = session_pb2.ForkSessionRequest(
            session_id=self.id,
            messages=_base.messages_to_proto(history or ()),
            settings=_base.settings_to_proto(settings),
            session_key=_base.new_session_key(),
        )
        pb = await self._call(client._stubs.sessions.ForkSession, request, timeout)
        state = _base.SessionState(id=pb.id, model=self.model, settings=settings)
        state.apply(pb, settings)
        return AsyncSession(client, state)

    async def export(self, *, timeout: float | None = None) -> bytes:
        """The session's cache (tokens, KV state, settings, model fingerprint) as one blob, for
        :meth:`AsyncModel.import_session` on any server of the same model."""
        client = self._client
        metadata = client._base.metadata(self._state.model, self._state.key)
        deadline = client._base.deadline(timeout, unary=True)
        request = session_pb2.ExportSessionRequest(session_id=self.id)
        parts: list[bytes] = []
        try:
            async for pb in client._stubs.sessions.ExportSession(
                request, metadata=metadata, timeout=deadline.remaining()
            ):
                parts.append(pb.data)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return b"".join(parts)

    async def warmup(self, history: HistoryLike, *, timeout: float | None = None) -> Usage:
        """Prefill ``history`` (e.g. a system prompt) into the cache without generating."""
        pb = await self._call(self._client._stubs.sessions.Warmup, self._state.warmup_request(history), timeout)
        return _base.usage_from_proto(pb.usage)

    async def info(self, *, timeout: float | None = None) -> SessionInfo:
        """The server's view of the session (context tokens, state, settings)."""
        request = session_pb2.GetSessionRequest(session_id=self.id)
        pb = await self._call(self._client._stubs.sessions.GetSession, request, timeout)
        return _base.session_info_from_proto(pb)

    async def context(self, *, timeout: float | None = None) -> int:
        """Tokens held in the session's KV cache on the server."""
        info = await self.info(timeout=timeout)
        return info.context_tokens

    async def set_settings(self, settings: Settings, *, timeout: float | None = None) -> Settings:
        """Replace the session's settings (unset fields take the server's defaults)."""
        request = session_pb2.UpdateSettingsRequest(session_id=self.id, settings=_base.settings_to_proto(settings))
        pb = await self._call(self._client._stubs.sessions.UpdateSettings, request, timeout)
        self._state.apply(pb, settings)
        return self._state.settings

    async def clear_cache(self, *, timeout: float | None = None) -> None:
        """Drop the session's KV cache; the next turn prefills its history from scratch."""
        request = session_pb2.ClearCacheRequest(session_id=self.id)
        await self._call(self._client._stubs.sessions.ClearCache, request, timeout)

    async def close(self, *, timeout: float | None = None) -> None:
        """Free the session on the server. Idempotent; a session already gone is fine."""
        if self._state.closed:
            return
        with contextlib.suppress(NotFound):  # the server forgot it already: closed is closed
            request = session_pb2.CloseSessionRequest(session_id=self.id)
            await self._call(self._client._stubs.sessions.CloseSession, request, timeout)
        self._state.closed = True

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state.describe()}>"
