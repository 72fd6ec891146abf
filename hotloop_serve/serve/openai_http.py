"""OpenAI-compatible HTTP API on Ray Serve's HTTP proxy (FastAPI), served by the model's replicas.

:class:`OpenAIApi` is an adapter over a replica's servicer core (``servicer.ModelServicer``:
the same engine, ids, authentication, limits and telemetry as the gRPC API). The routes are
declared on ``api`` by the Ray deployment (``deployment.ModelReplica``), which hands each to
this adapter.

Each model's application answers, under its route prefix ``/<model>``:

- ``GET /v1/models`` (and ``/v1/models/{id}``): the models this server serves;
- ``POST /v1/chat/completions``: a reply, streamed as server-sent events with ``"stream": true``;
- ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``, ``GET .../input_items``: the
  Responses API, whose stored responses live on their conversation's owner, with its session.

A request goes through the same bearer tokens (``Authorization: Bearer``), limits, engine and
telemetry as the gRPC API. The replica that receives it (Ray's HTTP proxy picks any) only
authenticates and parses; it hands the turn, as a :class:`ChatCall`, through the model's own
deployment handle to the conversation's **owner**, which the session-affinity router picks by
the conversation's key (``openai_schema.conversation_key``: the ``X-Session-Id`` header, else
the conversation's opening messages, with the principal). The owner serves it from a session
of its engine named after that key and signed for the principal, so a stateless client's
follow-up (the same messages plus new ones) prefills only its new tokens, and
``usage.prompt_tokens_details.cached_tokens`` says how many it reused. ``docs/openai.md``
explains the mapping and the isolation between principals.
"""

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import RequestStream
from hotloop_serve.engine.tools import ToolSpec
from hotloop_serve.errors import HotloopError, InternalError, NotFound, ResourceExhausted, Unavailable
from hotloop_serve.serve import openai_schema as oa
from hotloop_serve.serve import responses_schema as rs
from hotloop_serve.serve.fleet import TRANSFER_TIMEOUT_S
from hotloop_serve.serve.handle_calls import as_own_request
from hotloop_serve.serve.openai_choices import choice_settings, merge_choices
from hotloop_serve.serve.openai_tools import ReplyCalls, chat_tools, constrain
from hotloop_serve.serve.responses_disk import ResponseDisk
from hotloop_serve.serve.responses_handover import ResponseParcel, pack, unpack
from hotloop_serve.serve.responses_http import collect_response, item_page, response_events
from hotloop_serve.serve.responses_store import ResponseStore, StoredResponse
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.status import known as known_error
from hotloop_serve.serve.turns import Turn, guarded, submit

log = logging.getLogger("ray.serve")

api = FastAPI(title="hotloop-serve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)

ALTERNATE_SESSIONS = 8
"""Sessions one conversation key may use at once on its owner: a second request of the same
conversation while one runs gets the next one (else the engine would supersede the first)."""


class _TraceContext:
    """What ``Telemetry.rpc`` reads of a gRPC context: the caller's trace headers."""

    def __init__(self, traceparent: str | None) -> None:
        self._metadata = [("traceparent", traceparent)] if traceparent else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


def peer_of(request: Request) -> str:
    """The caller's address in gRPC's peer syntax (what ``Authenticator`` checks); unknown: not local."""
    client = request.client
    if client is None or not client.host:
        return "unknown"
    host = client.host
    return f"ipv6:[{host}]:{client.port}" if ":" in host else f"ipv4:{host}:{client.port}"


def error_response(e: BaseException) -> JSONResponse:
    e = known_error(e)
    if isinstance(e, HotloopError):
        status, body = oa.error_of(e)
    else:
        log.exception("unexpected error in the OpenAI API", exc_info=e)
        status, body = oa.error_json("INTERNAL", f"internal error ({type(e).__name__}); the server log has details")
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def failure_response(e: BaseException) -> Response:
    """The error response of a turn that could not start (Ray's routing errors mapped too)."""
    if isinstance(e, BackPressureError):  # every replica that could serve it is full, and Ray's queue
        return error_response(
            ResourceExhausted("every replica of this model is busy and its queue is full; retry later")
        )
    if isinstance(e, DeploymentUnavailableError):
        return error_response(Unavailable("no replica of this model is running; retry later"))
    return error_response(e)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def failed_item(e: Exception) -> HotloopError:
    """How the owner reports a failed turn to the receiving replica (``turns.guarded``): the
    error itself, as the stream's item (an item, not an exception: Ray would wrap an exception
    in its own); a bug is logged here and travels as INTERNAL without its details."""
    e = known_error(e)
    if isinstance(e, HotloopError):
        return e
    log.exception("unexpected error serving an OpenAI API turn", exc_info=e)
    return InternalError(f"internal error ({type(e).__name__})")


def _join_calls(calls: list[dict[str, Any]], pieces: list[dict[str, Any]]) -> None:
    """Add an item's call pieces to the calls so far (OpenAI's ``tool_calls`` shape)."""
    for piece in pieces:
        if "id" in piece:
            calls.append({"id": piece["id"], "type": "function", "function": {"name": piece["name"], "arguments": ""}})
        calls[piece["index"]]["function"]["arguments"] += piece["arguments"]


def _call_deltas(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """An item's call pieces as a chunk's ``delta.tool_calls`` (id, type and name on a call's first)."""
    out = []
    for piece in pieces:
        delta: dict[str, Any] = {"index": piece["index"], "function": {"arguments": piece["arguments"]}}
        if "id" in piece:
            delta.update(id=piece["id"], type="function")
            delta["function"]["name"] = piece["name"]
        out.append(delta)
    return {"tool_calls": out}


class _Reply:
    """One choice of a non-streamed reply, joined from its items."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish = "stop"

    def add(self, item: dict[str, Any]) -> None:
        self.text.append(item["text"])
        if "tool_calls" in item:
            _join_calls(self.calls, item["tool_calls"])
        if "logprobs" in item:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(item["logprobs"])
        if "finish_reason" in item:
            self.finish = item["finish_reason"]

    def choice(self, index: int) -> dict[str, Any]:
        text = "".join(self.text)
        message: dict[str, Any] = (
            {"content": text or None, "tool_calls": self.calls} if self.calls else {"content": text}
        )
        return oa.choice_json(index, message, self.finish, self.logprobs)


async def _collect(cid: str, model: str, n: int, first: dict[str, Any], items: Any) -> Response:
    """A non-streaming reply: every item joined into one ``chat.completion`` of ``n`` choices
    (an item's ``index`` says whose; the turn's last item is the one with ``usage``)."""
    replies = [_Reply() for _ in range(n)]
    item = first
    try:
        while True:
            if isinstance(item, HotloopError):
                return error_response(item)
            replies[item.get("index", 0)].add(item)
            if "usage" in item:
                break
            item = await items.__anext__()
    finally:  # the client left (Ray cancels this task), or an error: stop the turn on its replica
        items.cancel()
    body = oa.completion_json(cid, model, [r.choice(i) for i, r in enumerate(replies)], item["usage"])
    body["hotloop"] = item["hotloop"]
    return JSONResponse(body)


async def _events(
    cid: str, model: str, n: int, first: dict[str, Any], items: Any, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events: each choice's role delta, content deltas and finish reason (its
    ``index`` on each chunk), usage if asked, [DONE]. An error after the stream started is an
    ``{"error": ...}`` event (the OpenAI SDKs raise it)."""
    created = int(time.time())
    try:
        for i in range(n):
            yield _sse(oa.chunk_json(cid, model, created, {"role": "assistant", "content": ""}, index=i))
        item = first
        while True:
            if isinstance(item, HotloopError):
                _, body = oa.error_of(item)
                yield _sse(body)
                return
            i = item.get("index", 0)
            lp = item.get("logprobs")
            if item["text"] or lp:
                yield _sse(oa.chunk_json(cid, model, created, {"content": item["text"]}, logprobs=lp, index=i))
            if "tool_calls" in item:
                yield _sse(oa.chunk_json(cid, model, created, _call_deltas(item["tool_calls"]), index=i))
            if "finish_reason" in item:
                last = oa.chunk_json(cid, model, created, {}, item["finish_reason"], index=i)
                if "usage" in item:
                    last["hotloop"] = item["hotloop"]
                yield _sse(last)
            if "usage" in item:
                if include_usage:
                    chunk = oa.chunk_json(cid, model, created, {})
                    chunk["choices"] = []
                    chunk["usage"] = oa.usage_json(item["usage"])
                    yield _sse(chunk)
                yield _sse("[DONE]")
                return
            item = await items.__anext__()
    finally:
        items.cancel()


class LocalItems:
    """A turn's items served on this replica, read like a handle's streamed response.

    A turn whose conversation this replica owns runs here rather than through a handle call to
    itself: that call needs a second request slot of the same replica while the HTTP request
    holds one, so as many concurrent HTTP turns as half the replica's ``max_ongoing_requests``
    filled every slot with requests waiting for slots nobody would free, and every turn hung
    until its client gave up. (Ray's own self-calls also lost replies now and then:
    ``fleet.ReplicaFleet.create_at_owner``.)
    """

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self._items = items
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> "LocalItems":
        return self

    async def __anext__(self) -> Any:
        return await self._items.__anext__()

    def cancel(self) -> None:
        """End the turn (the engine's request is cancelled by the generator's close)."""
        aclose = getattr(self._items, "aclose", None)
        if aclose is not None and self._closing is None:
            self._closing = asyncio.ensure_future(_quietly(aclose()))


class ErrorsAsItems:
    """A turn's items, where a failure of the call itself arrives as the error item the adapters
    already answer (a 4xx/5xx before the first byte, an ``error`` event after it).

    The owner replica of a handed-over turn can die mid-stream: Ray then raises ActorDiedError
    from the stream, which would have broken the HTTP response (or, before the first item,
    become a 500); it is a retryable UNAVAILABLE (``status.replica_failure``).
    """

    def __init__(self, items: Any) -> None:
        self._items = items
        self._failed = False

    def __aiter__(self) -> "ErrorsAsItems":
        return self

    async def __anext__(self) -> Any:
        if self._failed:
            raise StopAsyncIteration
        try:
            return await self._items.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as e:
            self._failed = True
            return failed_item(e)

    def cancel(self) -> None:
        self._items.cancel()


async def _quietly(closing: Awaitable[None]) -> None:
    with contextlib.suppress(RuntimeError):  # already closing on the task that was reading it
        await closing


class OpenAIApi:
    """The OpenAI-compatible HTTP API of one replica, over its servicer ``core`` (see the module
    docstring). ``app`` and ``deployment`` name the model's Ray deployment: a turn is handed to
    its conversation's owner through its handle. The receiving half authenticates and parses;
    the owner's half (``OpenAIChat``, ``OpenAIRespond``, ``OpenAIStored``) holds the HTTP
    sessions and the stored responses."""

    def __init__(self, core: ModelServicer, app: str, deployment: str) -> None:
        self.core = core
        self.config, self.model, self.engine = core.config, core.model, core.engine
        self.ids, self.auth, self.telemetry = core.ids, core.auth, core.telemetry
        self.pacer = core.pacer  # one message budget for the replica's gRPC and HTTP streams
        self.served_by = core.served_by  # the core's own: a rank Ray reassigns shows in both
        self._app, self._deployment = app, deployment
        self._http_busy: set[str] = set()
        self._http_lru: OrderedDict[str, str] = OrderedDict()  # session id -> principal, oldest first
        self._closing: set[asyncio.Future[None]] = set()  # choices' sessions being closed
        limits = self.model.limits
        self._responses = ResponseStore(limits.responses_per_principal, limits.response_bytes_per_principal)
        persist_dir = self.engine.options.persist_dir
        self._response_disk = ResponseDisk(persist_dir) if persist_dir else None

    # -- the receiving replica ------------------------------------------------------------
    def _http_principal(self, request: Request) -> str:
        header = request.headers.get("authorization")
        metadata = [("authorization", header)] if header is not None else []
        return self.auth.principal(metadata, peer_of(request))

    async def _body(self, request: Request) -> bytes:
        limit = self.model.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise oa.RequestTooLarge(
                f"request body is {declared} bytes; this server accepts at most {limit} (limits.max_request_bytes)"
            )
        body = await request.body()
        if len(body) > limit:
            raise oa.RequestTooLarge(
                f"request body is {len(body)} bytes; this server accepts at most {limit} (limits.max_request_bytes)"
            )
        return body

    def _model_json(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "hotloop-serve"}

    async def list_models(self, request: Request) -> Response:
        try:
            self._http_principal(request)
        except HotloopError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._model_json(m.name) for m in self.config.models]})

    async def get_model(self, name: str, request: Request) -> Response:
        try:
            self._http_principal(request)
            if name not in {m.name for m in self.config.models}:
                raise NotFound(f"model {name!r} not found; GET /v1/models lists the models served")
        except HotloopError as e:
            return error_response(e)
        return JSONResponse(self._model_json(name))

    async def chat_completions(self, request: Request) -> Response:
        try:
            principal = self._http_principal(request)
            req = oa.parse_request(await self._body(request))
            session, traceparent = request.headers.get(oa.SESSION_HEADER), request.headers.get("traceparent")
            items, first = await self._open_turn(
                req.model,
                functools.partial(self._dispatch, req, principal, session, traceparent),
                "OpenAIForward",
                req, principal, session, traceparent,
            )  # fmt: skip
        except Exception as e:
            return failure_response(e)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _events(cid, req.model, req.n or 1, first, items, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _collect(cid, req.model, req.n or 1, first, items)

    async def _open_turn(
        self, model: str, here: Callable[[], Awaitable[Any]], forward: str, *args: Any
    ) -> tuple[Any, dict[str, Any]]:
        """A turn's stream of items and its first item (raised when it is an error): planned here
        (``here``) for this replica's model, or handed to another model's application (its method
        ``forward``), which plans and routes it there."""
        if model == self.model.name:
            items = await here()
        elif model in {m.name for m in self.config.models}:
            other = serve.get_deployment_handle(model, model)
            items = getattr(other.options(stream=True), forward).remote(*args)
        else:
            served = ", ".join(m.name for m in self.config.models)
            raise NotFound(f"model {model!r} not found; this server serves: {served}")
        items = ErrorsAsItems(items)
        first = await items.__anext__()
        if isinstance(first, HotloopError):
            items.cancel()
            raise first
        return items, first

    async def _dispatch(
        self, req: oa.ChatCompletionRequest, principal: str, session: str | None, traceparent: str | None
    ) -> Any:
        """Plan a turn of this model and hand it to its conversation's owner: the stream of its items."""
        messages = oa.messages_of(req, self.model.limits.max_messages)
        if req.response_format is not None or req.grammar:
            # Converting and bounding a schema or grammar takes milliseconds: off the event loop.
            settings = await asyncio.to_thread(oa.settings_of, req, self.engine.defaults)
        else:
            settings = oa.settings_of(req, self.engine.defaults)
        tools, choice, parallel = chat_tools(req)
        if tools:  # the tools' schemas are converted and bounded: milliseconds, off the event loop
            fmt = self.engine.template.tool_format
            settings = await asyncio.to_thread(constrain, settings, fmt, tools, choice, parallel)
        key = oa.conversation_key(principal, req.model, messages, session)
        parse = choice if tools and choice.calls else None
        call = oa.ChatCall(key, principal, messages, settings, traceparent, tools, parse, req.n or 1)
        if await self.core.fleet.owns(key):
            return LocalItems(self.OpenAIChat(call))
        handle = serve.get_deployment_handle(self._deployment, self._app)
        return handle.options(stream=True, session_id=key).OpenAIChat.remote(call)

    async def OpenAIForward(
        self, req: oa.ChatCompletionRequest, principal: str, session: str | None, traceparent: str | None
    ) -> AsyncIterator[dict[str, Any] | HotloopError]:
        """A turn for this model received by another model's endpoint (already authenticated)."""
        items = None
        try:
            items = await self._dispatch(req, principal, session, traceparent)
            async for item in items:
                yield item
        except HotloopError as e:
            yield e
        finally:
            if items is not None:
                items.cancel()

    # -- the Responses API, receiving side ------------------------------------------------
    async def create_response(self, request: Request) -> Response:
        try:
            principal = self._http_principal(request)
            req = rs.parse_response_request(await self._body(request))
            session, traceparent = request.headers.get(oa.SESSION_HEADER), request.headers.get("traceparent")
            items, first = await self._open_turn(
                req.model,
                functools.partial(self._respond, req, principal, session, traceparent),
                "OpenAIRespondForward",
                req, principal, session, traceparent,
            )  # fmt: skip
        except Exception as e:
            return failure_response(e)
        if req.stream:
            return StreamingResponse(
                response_events(first, items),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect_response(items)

    async def _respond(
        self, req: rs.ResponseRequest, principal: str, session: str | None, traceparent: str | None
    ) -> Any:
        """Plan a response of this model and hand it to its conversation's owner: the stream of
        its items. The conversation is ``previous_response_id``'s (its id holds the routing key),
        or a new one known by its opening, as a chat completion's."""
        tools, choice, parallel = rs.tools_of(req)
        fmt = self.engine.template.tool_format

        def plan() -> SamplingSettings:  # schemas converted and bounded: milliseconds, off the event loop
            settings = rs.settings_of(req, self.engine.defaults)
            return constrain(settings, fmt, tools, choice, parallel, tool_path="tools.{}")

        settings = await asyncio.to_thread(plan) if tools or req.text is not None else plan()
        if req.previous_response_id:
            key = rs.key_of(req.previous_response_id)
        else:
            opening, _ = rs.conversation_of(req, (), self.model.limits.max_messages)
            system = [ChatMessage("system", req.instructions)] if req.instructions else []
            key = oa.conversation_key(principal, req.model, [*system, *opening], session)
        parse = choice if tools and choice.calls else None
        call = rs.RespondCall(
            key,
            rs.new_response_id(key),
            principal,
            req,
            settings,
            tools,
            parse,
            rs.echo_of(req, tools, choice),
            traceparent,
        )
        if await self.core.fleet.owns(key):
            return LocalItems(self.OpenAIRespond(call))
        handle = serve.get_deployment_handle(self._deployment, self._app)
        return handle.options(stream=True, session_id=key).OpenAIRespond.remote(call)

    async def OpenAIRespondForward(
        self, req: rs.ResponseRequest, principal: str, session: str | None, traceparent: str | None
    ) -> AsyncIterator[dict[str, Any] | HotloopError]:
        """A response for this model received by another model's endpoint (already authenticated)."""
        items = None
        try:
            items = await self._respond(req, principal, session, traceparent)
            async for item in items:
                yield item
        except HotloopError as e:
            yield e
        finally:
            if items is not None:
                items.cancel()

    async def get_response(self, response_id: str, request: Request) -> Response:
        return await self._stored(request, response_id, "get", {})

    async def delete_response(self, response_id: str, request: Request) -> Response:
        return await self._stored(request, response_id, "delete", {})

    async def response_input_items(self, response_id: str, request: Request) -> Response:
        q = request.query_params
        limit = q.get("limit", "20")
        params = {
            "limit": int(limit) if limit.isdigit() else 20,
            "order": "asc" if q.get("order") == "asc" else "desc",
            "after": q.get("after"),
        }
        return await self._stored(request, response_id, "input_items", params)

    async def _stored(self, request: Request, response_id: str, op: str, params: dict[str, Any]) -> Response:
        """A stored response's operation, on its owner (the id's routing key finds it)."""
        try:
            principal = self._http_principal(request)
            key = rs.key_of(response_id)
            handle = serve.get_deployment_handle(self._deployment, self._app)
            result = await handle.options(session_id=key).OpenAIStored.remote(principal, response_id, op, params)
            if isinstance(result, HotloopError):
                raise result
        except Exception as e:
            return failure_response(e)
        return JSONResponse(result)

    # -- the conversation's owner ---------------------------------------------------------
    def _pick_session(self, key: str, principal: str) -> str:
        """The conversation's session on this replica: the key's own, or while that one is busy
        with another request of the conversation, an alternate (it shares the prefix: same principal)."""
        for n in range(ALTERNATE_SESSIONS):
            sid = self.ids.new(principal, key if n == 0 else f"{key}-{n}")
            if sid not in self._http_busy:
                return sid
        raise ResourceExhausted(
            f"{ALTERNATE_SESSIONS} requests of this conversation are already running; retry when one ends"
        )

    async def _evict_idle_session(self, principal: str) -> bool:
        """Close this principal's least recently used idle HTTP session (room for a new one)."""
        for sid, owner in self._http_lru.items():
            if owner == principal and sid not in self._http_busy:
                del self._http_lru[sid]
                if self.engine.known(sid):
                    await asyncio.to_thread(self.engine.close_session, sid, principal)
                return True
        return False

    async def _start(
        self,
        sid: str,
        principal: str,
        messages: list[ChatMessage],
        settings: SamplingSettings,
        tools: tuple[ToolSpec, ...],
        warmup: bool = False,
    ) -> RequestStream:
        """A reply (or with ``warmup``, only the prompt's prefill) in session ``sid``; a new
        session past the principal's limit evicts the principal's least recently used idle one."""
        start = functools.partial(self.engine.warmup if warmup else self.engine.generate, sid, principal, messages,
                                  settings, tools)  # fmt: skip
        try:
            return await submit(start)
        except ResourceExhausted:
            if self.engine.known(sid) or not await self._evict_idle_session(principal):
                raise
            return await submit(start)

    def _use_session(self, sid: str, principal: str) -> None:
        """Mark a session busy and most recently used (its principal's idle ones go first)."""
        self._http_busy.add(sid)
        self._http_lru[sid] = principal
        self._http_lru.move_to_end(sid)
        while len(self._http_lru) > self.engine.options.max_sessions:  # forget the oldest
            self._http_lru.popitem(last=False)

    async def OpenAIChat(self, call: oa.ChatCall) -> AsyncIterator[dict[str, Any] | HotloopError]:
        """Serve one chat turn here (the key's owner, or its next-ranked replica when the owner is
        full). Yields ``{"text", "logprobs"}`` items, then one with ``finish_reason`` and ``usage``;
        an error is the last item (:func:`failed_item`, before anything else), never an exception."""
        turn = Turn()
        async with contextlib.aclosing(guarded(self._chat(call, turn), turn, failed_item)) as items:
            async for item in items:
                yield item

    async def _chat(self, call: oa.ChatCall, turn: Turn) -> AsyncGenerator[dict[str, Any], None]:
        sid: str | None = None
        forks: list[str] = []
        try:
            with self.telemetry.rpc("ChatCompletions", _TraceContext(call.traceparent)) as span:
                sid = self._pick_session(call.session_key, call.principal)
                self._use_session(sid, call.principal)
                span.set_attribute("hotloop.session_id", sid)
                first_token = self._first_token(span)
                if call.n == 1:
                    turn.stream = stream = await self._start(
                        sid, call.principal, call.messages, call.settings, call.tools
                    )
                    replies = self._reply_items(stream, call, span, first_token)
                else:
                    replies = await self._choices(sid, call, turn, span, first_token, forks)
                async with contextlib.aclosing(replies) as items:  # its tasks end before the forks close
                    async for item in items:
                        yield item
        finally:
            if sid is not None:
                self._http_busy.discard(sid)
            if forks:  # the other choices' sessions: the conversation goes on in ``sid``
                self._close_later(forks, call.principal)

    def _first_token(self, span: Any) -> Callable[[], None]:
        """Records the turn's time to first token once (the first token of any of its choices)."""
        t0, seen = time.perf_counter(), False

        def mark() -> None:
            nonlocal seen
            if not seen:
                seen = True
                self.telemetry.first_token(span, time.perf_counter() - t0)

        return mark

    async def _reply_items(
        self, stream: RequestStream, call: oa.ChatCall, span: Any, first_token: Callable[[], None]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """One reply's items: ``{"text", "logprobs", "tool_calls"}``, the last with
        ``finish_reason``, ``usage`` and ``hotloop``."""
        fmt = self.engine.template.tool_format
        calls = ReplyCalls(fmt, call.tools, call.tool_choice) if call.tool_choice and fmt else None
        async for chunk in stream.chunks(pacer=self.pacer):
            first_token()
            item: dict[str, Any] = calls.item(chunk.text, chunk.final) if calls is not None else {"text": chunk.text}
            if chunk.logprobs is not None:
                item["logprobs"] = [oa.logprob_json(lp) for lp in chunk.logprobs]
            if chunk.final:
                self.telemetry.record_usage(span, chunk, "Generate")
                u = chunk.usage
                assert u is not None and chunk.finish_reason is not None
                reason = oa.FINISH_REASONS[chunk.finish_reason]
                if calls is not None:
                    reason = calls.finish_reason(chunk.finish_reason, reason)
                item["finish_reason"] = reason
                item["usage"] = {
                    "prompt_tokens": u.prompt_tokens,
                    "completion_tokens": u.completion_tokens,
                    "cached_tokens": u.cached_tokens + u.restored_tokens,
                }
                item["hotloop"] = oa.hotloop_json(chunk, self.served_by)
            yield item

    async def _choices(
        self,
        sid: str,
        call: oa.ChatCall,
        turn: Turn,
        span: Any,
        first_token: Callable[[], None],
        forks: list[str],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """``call.n`` choices (``openai_choices``): the prompt prefilled once into ``sid``, forked
        into new sessions (named in ``forks``, for the caller to close), then n requests at once."""
        principal = call.principal
        warm = await self._start(sid, principal, call.messages, call.settings, call.tools, warmup=True)
        turn.others.append(warm)
        prompt = await warm.aresult()
        self.telemetry.record_usage(span, prompt, "Warmup")
        assert prompt.usage is not None
        u = prompt.usage
        prompt_cache = {
            "cached_tokens": u.cached_tokens,
            "restored_tokens": u.restored_tokens,
            "prefilled_tokens": u.prefilled_tokens,
        }
        for _ in range(call.n - 1):
            fork = self.ids.new(principal, f"{call.session_key}-n{secrets.token_urlsafe(6)}")
            forks.append(fork)
            await self._fork(sid, principal, fork)
        replies = []
        for session, settings in zip([sid, *forks], choice_settings(call.settings, call.n), strict=True):
            stream = await self._start(session, principal, call.messages, settings, call.tools)
            turn.others.append(stream)
            replies.append(self._reply_items(stream, call, span, first_token))
        return merge_choices(replies, prompt_cache)

    async def _fork(self, sid: str, principal: str, fork: str) -> None:
        """A choice's session, starting with the prompt's cache; past the principal's session
        limit its least recently used idle session makes room (else the limit's 429)."""
        fork_it = functools.partial(self.engine.fork_session, sid, principal, fork)
        try:
            await asyncio.to_thread(fork_it)
        except ResourceExhausted:
            if not await self._evict_idle_session(principal):
                raise
            await asyncio.to_thread(fork_it)

    def _close_later(self, sessions: list[str], principal: str) -> None:
        """Close sessions off the event loop, without holding up the turn's end (a close
        cancels what still runs in them: a choice of a turn whose client left)."""

        def close() -> None:
            for session in sessions:
                with contextlib.suppress(HotloopError):
                    self.engine.close_session(session, principal)

        task = asyncio.ensure_future(asyncio.to_thread(close))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def OpenAIStored(
        self, principal: str, response_id: str, op: str, params: dict[str, Any]
    ) -> dict[str, Any] | HotloopError:
        """GET (``get``, ``input_items``) or DELETE a stored response held here: the body to send,
        or the error (returned, not raised: Ray would wrap it in its own)."""
        try:
            rec = await self._find_response(response_id, principal)
            if op == "delete":
                session = self._responses.delete(response_id, principal)
                if self._response_disk is not None:
                    await asyncio.to_thread(self._response_disk.remove, response_id)
                if session is not None and session not in self._http_busy:  # no record needs its cache
                    self._http_lru.pop(session, None)
                    if self.engine.known(session):
                        await asyncio.to_thread(self.engine.close_session, session, principal)
                return {"id": response_id, "object": "response", "deleted": True}
            if op == "input_items":
                return item_page(rec.input_items, params["limit"], params["order"], params["after"])
            return rec.body
        except HotloopError as e:
            return e

    async def _find_response(self, response_id: str, principal: str) -> StoredResponse:
        """A stored response of ``principal``: held here, or (after a restart or a fleet change)
        on disk under ``persist_dir``, or (a fleet change) on a peer, which gives its
        conversation (``responses_handover``); NotFound otherwise."""
        try:
            return self._responses.get(response_id, principal)
        except NotFound:
            rec = None
            if self._response_disk is not None:
                rec = await asyncio.to_thread(self._response_disk.load, response_id, principal)
            if rec is not None:
                self._responses.put(rec)
                return rec
            if not await self._pull_responses(rs.key_of(response_id), principal):
                raise
            return self._responses.get(response_id, principal)

    # -- stored responses between replicas (``responses_handover``) -------------------------
    async def _pull_responses(self, key: str, principal: str) -> bool:
        """Ask every peer at once for ``principal``'s records of conversation ``key``; whether
        any came. A peer that does not answer in time keeps its records."""

        async def ask(peer: str) -> ResponseParcel | None:
            handle = serve.get_deployment_handle(self._deployment, self._app).options(session_id=peer)
            try:
                call = as_own_request(lambda: handle.give_responses.remote(key, principal))
                given: ResponseParcel | None = await asyncio.wait_for(call, TRANSFER_TIMEOUT_S)
                return given
            except Exception as e:  # gone or slow: a 404 it is
                log.info("stored responses: peer %s did not give conversation %s: %r", peer, key[:12], e)
                return None

        parcels = await asyncio.gather(*(ask(peer) for peer in await self.core.fleet.peers()))
        got = False
        for parcel in parcels:
            if parcel is not None and parcel.records:
                await self.adopt_responses(parcel)
                got = True
        return got

    async def give_responses(self, key: str, principal: str) -> ResponseParcel | None:
        """A peer's pull: ``principal``'s records of conversation ``key`` and their sessions,
        forgotten here (None: none held)."""
        if not any(r.principal == principal for r in self._responses.records_of(key)):
            return None
        return await asyncio.to_thread(pack, self._responses, self.engine, key, principal, set(self._http_busy))

    async def adopt_responses(self, parcel: ResponseParcel) -> int:
        """Hold a conversation's records given or handed over by a peer (and on disk, when
        configured, under this replica's ``persist_dir``); the records taken."""
        adopted = await asyncio.to_thread(unpack, self._responses, self.engine, parcel)
        for sid, principal, _ in parcel.sessions:
            if sid in adopted:
                self._http_lru[sid] = principal  # evictable as this replica's own idle sessions
        if self._response_disk is not None:
            for rec in parcel.records:
                await asyncio.to_thread(self._response_disk.save, rec)
        return len(parcel.records)

    async def hand_over_responses(self, budget_s: float) -> int:
        """This replica is leaving: push each conversation's records (and their sessions) to its
        key's next owner, within ``budget_s``; the records sent. Two transfers in a row that time
        out stop it (nobody takes them)."""
        deadline = time.monotonic() + budget_s
        handle = serve.get_deployment_handle(self._deployment, self._app)
        sent = timeouts = 0
        for key in sorted(self._responses.keys()):
            left = deadline - time.monotonic()
            if left <= 0 or timeouts >= 2:
                break
            parcel = await asyncio.to_thread(pack, self._responses, self.engine, key, None, set(self._http_busy))
            try:
                call = handle.options(session_id=key).adopt_responses.remote(parcel)
                sent += await asyncio.wait_for(call, min(left, TRANSFER_TIMEOUT_S))
                timeouts = 0
            except TimeoutError:
                timeouts += 1
                log.info("hand-over of conversation %s's stored responses timed out", key[:12])
            except Exception as e:
                log.info("hand-over of conversation %s's stored responses failed: %r", key[:12], e)
        return sent

    async def _response_session(self, call: rs.RespondCall, prev: StoredResponse | None) -> str:
        """Where a response runs: a new conversation's session (as a chat's); the session of the
        response it continues when that session still ends with it; else a fork of that session
        (an older response continued: both branches stay hot), or a new session rebuilt from the
        history when the old one is gone."""
        if prev is None:
            return self._pick_session(call.key, call.principal)
        if (
            self._responses.is_head(prev.session, prev.id)
            and prev.session not in self._http_busy
            and self.engine.known(prev.session)
        ):
            return prev.session
        sid = self.ids.new(call.principal, f"{call.key}-{secrets.token_urlsafe(6)}")
        if self.engine.known(prev.session):
            try:
                await asyncio.to_thread(self.engine.fork_session, prev.session, call.principal, sid)
            except HotloopError as e:  # e.g. no room for another session: the history rebuilds it
                log.info("responses: could not fork %s (%s); rebuilding from the history", prev.session, e.message)
        return sid

    async def OpenAIRespond(self, call: rs.RespondCall) -> AsyncIterator[dict[str, Any] | HotloopError]:
        """Serve one response here (its conversation's owner). Yields a ``start`` item, text and
        call pieces, then an item with the finished ``response`` (stored when asked); an error is
        the last item (:func:`failed_item`, before anything else), never an exception."""
        turn = Turn()
        async with contextlib.aclosing(guarded(self._respond_here(call, turn), turn, failed_item)) as items:
            async for item in items:
                yield item

    async def _respond_here(self, call: rs.RespondCall, turn: Turn) -> AsyncGenerator[dict[str, Any], None]:
        sid: str | None = None
        req = call.request
        try:
            with self.telemetry.rpc("Responses", _TraceContext(call.traceparent)) as span:
                prev = None
                if req.previous_response_id:
                    prev = await self._find_response(req.previous_response_id, call.principal)
                history = prev.messages if prev is not None else ()
                if req.store:
                    self._responses.check_room(call.principal)
                new, input_items = rs.conversation_of(req, history, self.model.limits.max_messages)
                system = [ChatMessage("system", req.instructions)] if req.instructions else []
                sid = await self._response_session(call, prev)
                self._use_session(sid, call.principal)
                span.set_attribute("hotloop.session_id", sid)
                t0 = time.perf_counter()
                turn.stream = stream = await self._start(
                    sid, call.principal, [*system, *history, *new], call.settings, call.tools
                )
                created = int(time.time())
                message_id = "msg_" + secrets.token_hex(16)
                progress = rs.response_json(call.response_id, call.echo, "in_progress", [], None, created)
                yield {"start": {"message_id": message_id, "response": progress}}
                fmt = self.engine.template.tool_format
                calls = ReplyCalls(fmt, call.tools, call.tool_choice) if call.tool_choice and fmt else None
                text: list[str] = []
                first = True
                async for chunk in stream.chunks(pacer=self.pacer):
                    if first:
                        self.telemetry.first_token(span, time.perf_counter() - t0)
                        first = False
                    item: dict[str, Any] = (
                        calls.item(chunk.text, chunk.final) if calls is not None else {"text": chunk.text}
                    )
                    text.append(item["text"])
                    if chunk.final:
                        self.telemetry.record_usage(span, chunk, "Generate")
                        u = chunk.usage
                        assert u is not None
                        usage = {
                            "prompt_tokens": u.prompt_tokens,
                            "completion_tokens": u.completion_tokens,
                            "cached_tokens": u.cached_tokens + u.restored_tokens,
                        }
                        found = list(calls.calls) if calls is not None else []
                        status = "incomplete" if chunk.finish_reason in ("length", "context") else "completed"
                        output = rs.output_of(message_id, "".join(text), found)
                        body = rs.response_json(call.response_id, call.echo, status, output, usage, created)
                        if req.store:
                            reply = ChatMessage("assistant", "".join(text), tool_calls=tuple(found))
                            conversation = (*history, *new, reply)
                            rec = StoredResponse(call.response_id, call.principal, conversation, sid, body, input_items)
                            self._responses.put(rec)
                            if self._response_disk is not None:
                                await asyncio.to_thread(self._response_disk.save, rec)
                        else:
                            self._responses.moved(sid, None)
                        item["response"] = body
                        item["hotloop"] = oa.hotloop_json(chunk, self.served_by)
                    yield item
        finally:
            if sid is not None:
                self._http_busy.discard(sid)
