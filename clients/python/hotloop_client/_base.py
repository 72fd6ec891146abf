"""Everything the sync and asyncio clients share that does no I/O.

``Client`` and ``AsyncClient`` (and their ``Model``/``Session`` twins) differ only in how
they call the stubs; the wire contract lives here once so the twins cannot drift apart:

* proto <-> dataclass conversions (one function per direction),
* the metadata every call sends (``application`` for Ray Serve's proxy, the bearer
  token, W3C trace context),
* which failures are retried and how a broken stream is reported (:class:`StreamProgress`),
* the routing key a new session is created with,
* the Ray Serve proxy's ``ListApplications`` reply, decoded with generated code.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf.descriptor import FieldDescriptor
from hotloop.v1 import common_pb2, model_pb2, serve_proxy_pb2, session_pb2

from ._errors import HotloopError, TurnInterrupted, from_rpc_error, rich_details, status_of
from ._types import (
    Chunk,
    FinishReason,
    Message,
    ModelInfo,
    Role,
    ServedBy,
    SessionInfo,
    Settings,
    Timings,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

# --------------------------------------------------------------------------- routing

LIST_APPLICATIONS_METHOD = "/ray.serve.RayServeAPIService/ListApplications"
"""Ray Serve's own RPC on its gRPC proxy; it needs no ``application`` metadata."""

SESSION_KEY_PATTERN = re.compile(r"\A[A-Za-z0-9_-]{8,64}\Z")


def new_session_key() -> str:
    """A fresh routing key for ``CreateSessionRequest.session_key``.

    Chosen client-side so the session's identity exists before routing: the router hashes
    it, so CreateSession lands on the replica that will serve every later call (22 chars of
    ``[A-Za-z0-9_-]``, 128 random bits, so keys never collide in practice).
    """
    return secrets.token_urlsafe(16)


def decode_application_names(data: bytes) -> list[str]:
    """The application names of Ray Serve's ``ListApplicationsResponse``.

    Decoded by the code generated from ``protos/hotloop/v1/serve_proxy.proto`` (wire-compatible
    with Ray's message), so the SDK needs none of Ray (hundreds of MB) to read one list.
    """
    return list(serve_proxy_pb2.ListApplicationsResponse.FromString(data).application_names)


# --------------------------------------------------------------------------- metadata


def trace_metadata() -> list[tuple[str, str]]:
    """W3C trace context of the caller's current span, if OpenTelemetry is installed.

    Imported lazily (and optional) so the SDK keeps two dependencies; the server joins its
    spans to the caller's trace through these headers.
    """
    try:
        from opentelemetry import propagate, trace
    except ImportError:  # pragma: no cover - depends on the environment
        return []
    if not trace.get_current_span().get_span_context().is_valid:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    # gRPC metadata keys must be lowercase.
    return [(key.lower(), value) for key, value in carrier.items()]


def call_metadata(
    application: str | None, token: str | None, session_key: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The metadata of one call.

    ``application`` is how Ray Serve's gRPC proxy picks the app, and each model is its own
    app named after the model. A session's calls send its routing key as ``session_id``, which
    the proxy hands to the session-affinity router, so the router never decodes a request (a
    4 MiB history) to find it. The bearer token and trace context ride along.
    """
    md: list[tuple[str, str]] = []
    if application:
        md.append(("application", application))
    if session_key:
        md.append(("session_id", session_key))
    if token:
        md.append(("authorization", f"Bearer {token}"))
    md.extend(trace_metadata())
    return tuple(md)


# --------------------------------------------------------------------------- retries

MAX_ATTEMPTS = 6
"""One try and up to five retries of a failover (a replica or Ray's proxy restarting), spaced
by :func:`backoff`: about 3 to 6 s of retrying in all at the default ``retry_delay``, the time
a replica or the proxy takes to come back; a longer outage is reported, not hidden."""
MAX_RETRY_DELAY_S = 3.2
"""The longest pause between two attempts."""
DEFAULT_UNARY_TIMEOUT_S = 30.0
"""The deadline of a unary call (retries included) when neither the call nor the client sets
one: a server that stopped answering fails the call instead of hanging it."""


def backoff(retry_delay: float, attempt: int, rng: Callable[[], float] = random.random) -> float:
    """The pause after failed attempt ``attempt`` (1, 2, ...): ``retry_delay`` doubled per
    attempt, capped at :data:`MAX_RETRY_DELAY_S`, half of it random (equal jitter), so clients
    cut off by the same restart do not all come back at the same instant."""
    full = min(MAX_RETRY_DELAY_S, retry_delay * 2.0 ** (attempt - 1))
    return full / 2 + rng() * full / 2


_ACTOR_DIED_MARKERS = (
    "actor died",
    "actordiederror",
    "rayactorerror",
    "replica",
    "actor is temporarily unavailable",  # its node was lost (ActorUnavailableError)
    "may or may not have been executed on the actor",  # the same, over the gRPC transport
)


_APP_NOT_FOUND = "not found. Ping /ray.serve.RayServeAPIService/ListApplications"
"""Ray Serve's gRPC proxy's NOT_FOUND for an application it does not (yet) route to."""


def is_failover(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failure means "the replica went away", so the same request may be re-sent.

    UNAVAILABLE is the transport's word for it; Ray Serve's proxy reports a replica that
    died mid-request as INTERNAL with the Ray exception's text, so INTERNAL counts only
    when its details say so (a genuine server bug must not be retried silently).
    """
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code == grpc.StatusCode.INTERNAL:
        lowered = details.lower()
        return any(marker in lowered for marker in _ACTOR_DIED_MARKERS)
    if code == grpc.StatusCode.NOT_FOUND:
        # Ray's proxy, up before the model's application is (the server is starting or
        # restarting): the model is there seconds later. A model that does not exist costs
        # MAX_ATTEMPTS retries (a few seconds) before NotFound; hotloop-serve's own NOT_FOUND
        # carries rich details and never reaches here.
        return _APP_NOT_FOUND in details
    return False


def retriable(exc: BaseException) -> bool:
    """Whether the same request may be re-sent after ``exc``.

    hotloop-serve says so itself in its rich status (``RetryInfo``; its errors always carry an
    ``ErrorInfo``, so one without ``RetryInfo`` is not retried, whatever its text says). Errors
    without rich details come from gRPC or from Ray's proxy (a replica that died): for those,
    :func:`is_failover` decides from the code and Ray's wording.
    """
    reason, _, retry_delay = rich_details(exc)
    if retry_delay is not None:
        return True
    if reason is not None:
        return False
    return is_failover(*status_of(exc))


class Deadline:
    """A call's overall deadline, shared by its attempts so a retry cannot double it."""

    __slots__ = ("_at",)

    def __init__(self, timeout: float | None) -> None:
        self._at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left for the next attempt (gRPC's ``timeout=``), ``None`` for no limit."""
        if self._at is None:
            return None
        return max(self._at - time.monotonic(), 0.0)


class StreamProgress:
    """The state of one Generate turn across its attempts.

    Before any text reached the caller, a failover error is invisible to them: re-send the
    request. After text was delivered, a silent retry would repeat or contradict it, so the
    caller gets :class:`TurnInterrupted` with what they already have.
    """

    __slots__ = ("attempts", "chunks", "parts")

    def __init__(self) -> None:
        self.attempts = 1
        self.chunks = 0
        self.parts: list[str] = []

    def delivered(self, chunk: Chunk) -> None:
        """Record a chunk just handed to the caller."""
        self.chunks += 1
        if chunk.text:
            self.parts.append(chunk.text)

    def direct_refused(self, exc: BaseException) -> bool:
        """Whether a direct call (``direct=True``) that failed with ``exc`` should be sent again
        through the proxy, at once and without counting an attempt: RESOURCE_EXHAUSTED before
        any chunk. A replica's direct ingress refuses calls past its bound
        (``server.direct_max_streams``, reason ``DIRECT_INGRESS_FULL``) that way: the replica is
        healthy, only full on that path, so it is not avoided (:meth:`DirectRoutes.failed`);
        the proxy's router, which counts the replica's slots, places the turn. Any other
        exhaustion (the engine's queue, a quota) the proxy reports again, as a proxied turn would."""
        return self.chunks == 0 and status_of(exc)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED

    def should_retry(self, exc: BaseException) -> bool:
        """Whether to start another attempt after ``exc`` (and count it)."""
        if self.parts or self.attempts >= MAX_ATTEMPTS or not retriable(exc):
            return False
        self.attempts += 1
        return True

    def error(self, exc: BaseException) -> HotloopError:
        """The SDK error to raise for ``exc`` when not retrying."""
        code, details = status_of(exc)
        if self.parts and retriable(exc):
            return TurnInterrupted(details, "".join(self.parts), code)
        return from_rpc_error(exc)


def should_retry_unary(exc: BaseException, attempt: int) -> bool:
    """Unary RPCs are idempotent, so a retriable error is retried (up to MAX_ATTEMPTS attempts)."""
    return attempt < MAX_ATTEMPTS and retriable(exc)


# --------------------------------------------------------------------------- conversions

_ROLE_TO_PROTO = {
    Role.SYSTEM: common_pb2.ROLE_SYSTEM,
    Role.USER: common_pb2.ROLE_USER,
    Role.ASSISTANT: common_pb2.ROLE_ASSISTANT,
    Role.TOOL: common_pb2.ROLE_TOOL,
}
_FINISH_FROM_PROTO = {
    common_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_CONTEXT: FinishReason.CONTEXT,
    common_pb2.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
}
# Derived from the message descriptor, so a field added to ``hotloop.v1.Settings`` needs no
# list edited here: the ``optional`` scalars (presence = set), and the float32 ones.
_SETTINGS_FIELDS = common_pb2.Settings.DESCRIPTOR.fields
_OPTIONAL_SETTINGS = tuple(f.name for f in _SETTINGS_FIELDS if f.has_presence)
_FLOAT32_SETTINGS = frozenset(f.name for f in _SETTINGS_FIELDS if f.type == FieldDescriptor.TYPE_FLOAT)

MessageLike = Message | tuple[Role | str, str]
"""A ``Message``, or a ``(role, content)`` pair such as ``("user", "hi")``."""
HistoryLike = Sequence[MessageLike]
"""A conversation, oldest message first."""


def as_messages(history: Iterable[MessageLike]) -> list[Message]:
    """Normalise a history to ``Message``s; a bad role raises ``ValueError`` before any RPC."""
    messages: list[Message] = []
    for item in history:
        if isinstance(item, Message):
            messages.append(item)
        else:
            role, content = item
            messages.append(Message(role if isinstance(role, Role) else Role(str(role).lower()), content))
    return messages


def without_last_reply(history: HistoryLike) -> list[Message]:
    """The history to send to regenerate its last reply: everything before the final assistant
    message (the server reuses the cache up to there)."""
    messages = as_messages(history)
    if not messages or messages[-1].role != Role.ASSISTANT:
        raise ValueError("the history does not end with an assistant reply to regenerate")
    return messages[:-1]


def with_message_replaced(history: HistoryLike, index: int, content: str) -> list[Message]:
    """The history to send after editing message ``index``: it, changed, and everything before it.

    What followed the edited message belonged to the old branch. The server reuses the cache
    exactly up to the first token that differs, so an early edit costs only the tokens after it.
    """
    messages = as_messages(history)
    if not -len(messages) <= index < len(messages):
        raise IndexError(f"message {index} is not in a history of {len(messages)}")
    index %= len(messages)
    return [*messages[:index], Message(messages[index].role, content)]


IMPORT_PART_BYTES = 1 << 20
"""Size of each ImportSession part (the server accepts up to 1 MiB per part)."""


def import_requests(
    model: str, key: str, data: bytes, settings: Settings | None
) -> list[session_pb2.ImportSessionRequest]:
    """An exported blob as the ordered ImportSession parts, all with the same routing key."""
    parts = [data[i : i + IMPORT_PART_BYTES] for i in range(0, len(data), IMPORT_PART_BYTES)] or [b""]
    proto_settings = settings_to_proto(settings) if settings is not None else None
    return [
        session_pb2.ImportSessionRequest(
            model=model,
            session_key=key,
            settings=proto_settings,
            data=part,
            offset=i * IMPORT_PART_BYTES,
            total_bytes=len(data),
        )
        for i, part in enumerate(parts)
    ]


def messages_to_proto(history: Iterable[MessageLike]) -> list[common_pb2.Message]:
    """``Message``s (or pairs) as ``hotloop.v1.Message`` protos."""
    return [
        common_pb2.Message(
            role=_ROLE_TO_PROTO[m.role],
            content=m.content,
            tool_calls=[common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
            tool_call_id=m.tool_call_id,
        )
        for m in as_messages(history)
    ]


def tools_to_proto(tools: Iterable[Tool]) -> list[common_pb2.Tool]:
    """``Tool``s as ``hotloop.v1.Tool`` protos (a dict schema as JSON text)."""
    out = []
    for t in tools:
        params = t.parameters if isinstance(t.parameters, str) or t.parameters is None else json.dumps(t.parameters)
        out.append(common_pb2.Tool(name=t.name, description=t.description, parameters=params or ""))
    return out


def assistant_message(chunks: Iterable[Chunk]) -> Message:
    """The assistant message a streamed reply makes (its text and its calls joined), to append
    to the history before the calls' results."""
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        text.append(chunk.text)
        for d in chunk.tool_calls:
            entry = calls.setdefault(d.index, [d.id, d.name, ""])
            entry[2] += d.arguments
    return Message(Role.ASSISTANT, "".join(text), tuple(ToolCall(*calls[i]) for i in sorted(calls)))


def settings_to_proto(settings: Settings) -> common_pb2.Settings:
    """``Settings`` as ``hotloop.v1.Settings``: unset fields stay absent on the wire."""
    pb = common_pb2.Settings()
    for name in _OPTIONAL_SETTINGS:
        value = getattr(settings, name)
        if value is not None:
            setattr(pb, name, value)
    if settings.stop:
        pb.stop.extend(settings.stop)
    return pb


def settings_from_proto(pb: common_pb2.Settings) -> Settings:
    """``hotloop.v1.Settings`` as ``Settings``.

    Float fields are float32 on the wire; they are rounded to float32's precision so that
    ``Settings(temperature=0.7)`` survives a round trip equal to itself.
    """
    values: dict[str, Any] = {}
    for field, value in pb.ListFields():  # the fields present: set optionals, a non-empty stop
        if field.name in _FLOAT32_SETTINGS:
            values[field.name] = float(f"{value:.7g}")
        else:
            values[field.name] = tuple(value) if field.name == "stop" else value
    return Settings(**values)


def usage_from_proto(pb: common_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=pb.prompt_tokens,
        cached_tokens=pb.cached_tokens,
        restored_tokens=pb.restored_tokens,
        prefilled_tokens=pb.prefilled_tokens,
        completion_tokens=pb.completion_tokens,
    )


def timings_from_proto(pb: common_pb2.Timings) -> Timings:
    return Timings(
        queue_ms=pb.queue_ms,
        prefill_ms=pb.prefill_ms,
        time_to_first_token_ms=pb.time_to_first_token_ms,
        decode_ms=pb.decode_ms,
    )


def served_by_from_proto(pb: common_pb2.ServedBy) -> ServedBy:
    return ServedBy(replica=pb.replica, replica_rank=pb.replica_rank, cache_hit=pb.cache_hit)


def chunk_from_proto(pb: session_pb2.GenerateChunk) -> Chunk:
    """``GenerateChunk`` as ``Chunk``; the last-chunk fields are ``None`` when absent."""
    return Chunk(
        text=pb.text,
        finish_reason=_FINISH_FROM_PROTO.get(pb.finish_reason),
        usage=usage_from_proto(pb.usage) if pb.HasField("usage") else None,
        timings=timings_from_proto(pb.timings) if pb.HasField("timings") else None,
        served_by=served_by_from_proto(pb.served_by) if pb.HasField("served_by") else None,
        logprobs=tuple(
            TokenLogprob(lp.token, lp.piece, lp.logprob, tuple((t.token, t.piece, t.logprob) for t in lp.top))
            for lp in pb.logprobs
        ),
        tool_calls=tuple(ToolCallDelta(d.index, d.id, d.name, d.arguments) for d in pb.tool_calls),
    )


def model_info_from_proto(pb: model_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        name=pb.name,
        architecture=pb.architecture,
        context_length=pb.context_length,
        train_context_length=pb.train_context_length,
        quantization=pb.quantization,
        has_chat_template=pb.has_chat_template,
        chat_template_source=pb.chat_template_source,
        parameters=pb.parameters,
        size_bytes=pb.size_bytes,
        vocab_size=pb.vocab_size,
        replicas=pb.replicas,
    )


def session_info_from_proto(pb: session_pb2.Session) -> SessionInfo:
    return SessionInfo(
        id=pb.id,
        model=pb.model,
        settings=settings_from_proto(pb.settings),
        context_tokens=pb.context_tokens,
        state=pb.state,
        served_by=served_by_from_proto(pb.served_by) if pb.HasField("served_by") else None,
        last_used=pb.last_used_unix,
    )


# --------------------------------------------------------------------------- client state


def channel_credentials(tls: bool, root_certificates: bytes | None) -> Any:
    """TLS credentials for the channel, or ``None`` for plaintext.

    Giving ``root_certificates`` implies TLS: asking to trust a CA over plaintext is a
    configuration mistake, not a request for plaintext.
    """
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def open_channel(base: BaseClient, address: str | None = None) -> Any:
    """A blocking ``grpc.Channel`` for ``base`` (the sync client's transport), to its address
    or to ``address`` (a replica's own server: plaintext, see :class:`DirectRoutes`)."""
    if address is not None:
        return grpc.insecure_channel(address, options=base.options)
    if base.credentials is None:
        return grpc.insecure_channel(base.address, options=base.options)
    return grpc.secure_channel(base.address, base.credentials, options=base.options)


def open_aio_channel(base: BaseClient, address: str | None = None) -> Any:
    """A ``grpc.aio.Channel`` for ``base`` (or ``address``, as :func:`open_channel`), to be
    made inside the event loop that uses it."""
    if address is not None:
        return grpc.aio.insecure_channel(address, options=base.options)
    if base.credentials is None:
        return grpc.aio.insecure_channel(base.address, options=base.options)
    return grpc.aio.secure_channel(base.address, base.credentials, options=base.options)


# --------------------------------------------------------------------------- direct ingress

DIRECT_ROUTING = "rendezvous-blake2b-v1"
"""The one hash of a session's key over replica ranks this client knows (``ListReplicas.routing``)."""
AVOID_S = 10.0
"""How long a replica whose direct call failed is left to the proxy's routing."""


def now() -> float:
    """The clock of direct routes' expiry (monotonic)."""
    return time.monotonic()


def owner_rank(key: str, ranks: Iterable[int]) -> int:
    """The rank owning routing key ``key``: rendezvous hashing, the highest
    ``blake2b(key "\\0" rank)`` wins, as the server's session-affinity router computes it (a turn
    sent directly lands where the proxy would send it)."""

    def score(rank: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{key}\0{rank}".encode(), digest_size=8).digest(), "big")

    return max(ranks, key=score)


class DirectRoutes:
    """One model's replicas and their own gRPC servers (``ListReplicas``), for ``direct=True``.

    A session's turns go to the replica owning its key, skipping the proxy; where its address is
    unknown, the list is older than the server's ``refresh_s``, or a direct call to that replica
    failed lately, they go through the proxy as without ``direct``. A wrong guess is never
    wrong, only slower: the replica reached fetches the session's cache from its owner.
    """

    __slots__ = ("_addresses", "_avoid", "_expires")

    def __init__(self, response: model_pb2.ListReplicasResponse | None, now: float) -> None:
        known = response is not None and response.routing == DIRECT_ROUTING
        self._addresses = {r.rank: r.address for r in response.replicas} if known and response else {}
        self._expires = now + (max(response.refresh_s, 1) if known and response else 30.0)
        self._avoid: dict[str, float] = {}

    def stale(self, now: float) -> bool:
        return now >= self._expires

    def address_for(self, key: str, now: float) -> str | None:
        """The owner's direct address, or None for the proxy."""
        if not self._addresses:
            return None
        address = self._addresses[owner_rank(key, self._addresses)]
        if not address or self._avoid.get(address, 0.0) > now:
            return None
        return address

    def inherit(self, older: DirectRoutes) -> None:
        """Keep the replicas ``older`` was told to avoid (a fresh list may still name them)."""
        self._avoid.update(older._avoid)

    def failed(self, address: str, now: float) -> None:
        """A direct call to ``address`` failed as a failover would: the proxy routes its
        sessions for a while, and the list is asked for again."""
        self._avoid[address] = now + AVOID_S
        self._expires = min(self._expires, now)


class BaseClient:
    """Connection settings and call plumbing shared by ``Client`` and ``AsyncClient``."""

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
        if not address:
            raise ValueError("address must be host:port")
        if direct and (tls or root_certificates is not None):
            raise ValueError("direct=True talks plaintext to replicas inside the cluster: not with TLS")
        self.direct = direct
        self.address = address
        self.timeout = timeout
        self.retry_delay = retry_delay
        self._token = token
        self.credentials = channel_credentials(tls, root_certificates)
        self.options = list(options)

    def metadata(self, application: str | None, session_key: str | None = None) -> tuple[tuple[str, str], ...]:
        return call_metadata(application, self._token, session_key)

    def deadline(self, timeout: float | None, *, unary: bool = False) -> Deadline:
        """A per-call ``timeout`` wins over the client's default; a unary call with neither gets
        :data:`DEFAULT_UNARY_TIMEOUT_S` (a stream has no default: a reply may be long)."""
        chosen = timeout if timeout is not None else self.timeout
        if chosen is None and unary:
            chosen = DEFAULT_UNARY_TIMEOUT_S
        return Deadline(chosen)

    def backoff(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (see :func:`backoff`)."""
        return backoff(self.retry_delay, attempt)

    def describe(self) -> str:
        """``host:port (tls|plaintext)``, for the twins' reprs."""
        return f"{self.address} ({'tls' if self.credentials is not None else 'plaintext'})"


@dataclass(slots=True)
class SessionState:
    """What a session object knows locally: its server id, model and current settings.

    The settings are kept here and sent with every request, because the server's session is
    a cache that may be rebuilt on another replica that never saw CreateSession.
    """

    id: str
    model: str
    settings: Settings
    closed: bool = False

    @property
    def key(self) -> str:
        """The routing key: the id's part before the first dot (sent as ``session_id`` metadata)."""
        return self.id.split(".", 1)[0]

    def apply(self, pb: session_pb2.Session, sent: Settings) -> None:
        """Adopt the settings the server reports (every field filled in), else what we sent."""
        if pb.HasField("settings"):
            reported = settings_from_proto(pb.settings)
            if reported != Settings():
                self.settings = reported
                return
        self.settings = sent

    def turn_settings(self, overrides: dict[str, Any]) -> Settings:
        """The session's settings with per-turn keyword overrides (unknown names: TypeError)."""
        return self.settings.merged(Settings(**overrides)) if overrides else self.settings

    def generate_request(
        self,
        history: HistoryLike,
        overrides: dict[str, Any],
        tools: Sequence[Tool] = (),
        tool_choice: str = "",
        parallel_tool_calls: bool | None = None,
    ) -> session_pb2.GenerateRequest:
        messages = messages_to_proto(history)
        if not messages:
            raise ValueError("history is empty: send at least one message")
        request = session_pb2.GenerateRequest(
            session_id=self.id,
            messages=messages,
            settings=settings_to_proto(self.turn_settings(overrides)),
            tools=tools_to_proto(tools),
            tool_choice=tool_choice,
        )
        if parallel_tool_calls is not None:
            request.parallel_tool_calls = parallel_tool_calls
        return request

    def warmup_request(self, history: HistoryLike) -> session_pb2.WarmupRequest:
        return session_pb2.WarmupRequest(
            session_id=self.id, messages=messages_to_proto(history), settings=settings_to_proto(self.settings)
        )

    def describe(self) -> str:
        """``<id> model='<name>'[ closed]``, for the session objects' reprs."""
        return f"{self.id} model={self.model!r}{' closed' if self.closed else ''}"


def create_session_request(model: str, settings: Settings, key: str) -> session_pb2.CreateSessionRequest:
    return session_pb2.CreateSessionRequest(model=model, settings=settings_to_proto(settings), session_key=key)


def list_replicas_request(model: str) -> model_pb2.ListReplicasRequest:
    return model_pb2.ListReplicasRequest(model=model)


def list_models_request() -> model_pb2.ListModelsRequest:
    return model_pb2.ListModelsRequest()


def get_model_request(model: str) -> model_pb2.GetModelRequest:
    return model_pb2.GetModelRequest(model=model)


def tokenize_request(model: str, text: str, add_special: bool) -> model_pb2.TokenizeRequest:
    return model_pb2.TokenizeRequest(model=model, text=text, add_special=add_special)
