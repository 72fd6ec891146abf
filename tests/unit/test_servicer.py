"""The servicer's one wrapper of unary RPCs (``servicer.unary``), without an engine: errors
become statuses through ``status.py`` with an empty reply, a client's cancel is re-raised
(never INTERNAL), and Ray Serve still sees the ``grpc_context`` parameter."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from hotloop.v1 import common_pb2, session_pb2

from hotloop_serve.config import Config
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import InvalidArgument, Unavailable
from hotloop_serve.serve.auth import ANONYMOUS, Authenticator
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.session_ids import SessionIds
from hotloop_serve.serve.status import code_of, set_status
from hotloop_serve.telemetry import Telemetry

UNARY_RPCS = (
    "ListModels",
    "GetModel",
    "Tokenize",
    "CreateSession",
    "GetSession",
    "UpdateSettings",
    "ClearCache",
    "CloseSession",
    "Warmup",
)


class Context:
    """What the servicer uses of Ray Serve's gRPC context: metadata in, status out."""

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self._metadata = metadata or []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, bytes], ...] = ()

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: list[tuple[str, bytes]]) -> None:
        assert isinstance(metadata, list)  # Ray's context does ``[request_id] + metadata``
        self.trailing = tuple(metadata)

    def rich(self) -> status_pb2.Status:
        """The ``google.rpc.Status`` a stock client reads from the trailer."""
        (value,) = [v for k, v in self.trailing if k == "grpc-status-details-bin"]
        return status_pb2.Status.FromString(value)


class FakeEngine:
    """Just enough engine for ClearCache (blocks until released) and CloseSession."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail: BaseException | None = None
        self.defaults = SamplingSettings()

    def known(self, sid: str) -> bool:
        return True

    def clear_cache(self, sid: str, principal: str) -> None:
        self.entered.set()
        if self.fail is not None:
            raise self.fail
        self.release.wait(5)

    def close_session(self, sid: str, principal: str) -> None:
        pass

    def generate(self, sid: str, principal: str, messages: Any, settings: Any, tools: Any = ()) -> FakeStream:
        """A submission that takes a while (the scheduler's inbox is busy, say)."""
        self.entered.set()
        self.release.wait(5)
        self.stream = FakeStream()
        return self.stream


class FakeStream:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def servicer(tokens: dict[str, str] | None = None) -> tuple[ModelServicer, FakeEngine, SessionIds]:
    config = Config.model_validate({"models": [{"name": "m", "path": "/nonexistent.gguf"}]})
    engine = FakeEngine()
    ids = SessionIds(b"secret", "m")
    auth = Authenticator(tokens or {})
    return ModelServicer(config, config.models[0], engine, ids, auth, Telemetry("m", "r0")), engine, ids  # type: ignore[arg-type]


@pytest.mark.parametrize("name", UNARY_RPCS)
def test_ray_sees_the_rpc_name_and_grpc_context(name: str) -> None:
    # What Ray Serve's replica reads (UserMethodInfo.from_callable): the name and a parameter
    # named exactly grpc_context, on the method the proxy calls.
    method = getattr(ModelServicer, name)
    assert method.__name__ == name
    assert list(inspect.signature(method).parameters) == ["self", "request", "grpc_context"]
    assert not hasattr(method, "__wrapped__")


def test_a_hotloop_error_becomes_its_status_with_an_empty_reply() -> None:
    s, _, _ = servicer()
    ctx = Context()
    reply = asyncio.run(s.GetSession(session_pb2.GetSessionRequest(session_id="nope"), ctx))
    assert reply == session_pb2.Session()
    assert ctx.code == grpc.StatusCode.NOT_FOUND, ctx.details


def test_authentication_happens_in_the_wrapper() -> None:
    s, _, ids = servicer({"alice": "a-long-enough-token"})
    sid = ids.new("alice", "key-12345")
    ctx = Context()
    asyncio.run(s.ClearCache(session_pb2.ClearCacheRequest(session_id=sid), ctx))
    assert ctx.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_bug_is_internal_and_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    s, engine, ids = servicer()
    engine.fail = RuntimeError("boom")
    ctx = Context()
    reply = asyncio.run(s.ClearCache(session_pb2.ClearCacheRequest(session_id=ids.new(ANONYMOUS, "k" * 8)), ctx))
    assert reply == session_pb2.Session()
    assert ctx.code == grpc.StatusCode.INTERNAL
    assert "boom" not in ctx.details  # the details name the class; the log has the trace
    assert "RuntimeError" in ctx.details


def test_a_client_cancel_is_re_raised_not_reported_as_internal() -> None:
    s, engine, ids = servicer()
    sid = ids.new(ANONYMOUS, "key-12345")
    ctx = Context()

    async def cancel_mid_call() -> None:
        task = asyncio.create_task(s.ClearCache(session_pb2.ClearCacheRequest(session_id=sid), ctx))
        await asyncio.to_thread(engine.entered.wait, 5)
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            engine.release.set()

    asyncio.run(cancel_mid_call())
    assert ctx.code is None


def test_a_cancel_while_submitting_cancels_the_request_once_it_exists() -> None:
    s, engine, ids = servicer()
    hello = [common_pb2.Message(role=common_pb2.ROLE_USER, content="hi")]
    request = session_pb2.GenerateRequest(session_id=ids.new(ANONYMOUS, "key-12345"), messages=hello)

    async def cancel_during_submit() -> None:
        stream = s.Generate(request, Context())
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(engine.entered.wait, 5)  # submission in progress, in its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.release.set()  # the submission completes after the caller left (the loop runs on)
        for _ in range(100):
            if getattr(engine, "stream", None) is not None and engine.stream.cancelled.is_set():
                return
            await asyncio.sleep(0.05)

    asyncio.run(cancel_during_submit())
    assert engine.stream.cancelled.is_set()  # not orphaned


def test_unary_replies_pass_through() -> None:
    s, engine, ids = servicer()
    engine.release.set()
    sid = ids.new(ANONYMOUS, "key-12345")
    ctx = Context()
    reply: Any = asyncio.run(s.CloseSession(session_pb2.CloseSessionRequest(session_id=sid), ctx))
    assert reply == session_pb2.CloseSessionResponse()
    assert ctx.code is None
    again = Context()
    asyncio.run(s.GetSession(session_pb2.GetSessionRequest(session_id=sid), again))
    assert again.code == grpc.StatusCode.NOT_FOUND  # closed is closed


def test_status_is_the_one_mapping() -> None:
    assert code_of(InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(asyncio.CancelledError()) == grpc.StatusCode.CANCELLED
    assert code_of(GeneratorExit()) == grpc.StatusCode.CANCELLED
    assert code_of(KeyError("bug")) == grpc.StatusCode.INTERNAL


def details_of(status: status_pb2.Status) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for any_ in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if any_.Is(cls.DESCRIPTOR):
                message = cls()
                any_.Unpack(message)
                out[cls.__name__] = message
    return out


def test_errors_carry_the_richer_error_model() -> None:
    s, _, ids = servicer()
    sid = ids.new(ANONYMOUS, "key-12345")
    # A bad setting: "fix your request", naming the field (found without reading the message).
    ctx = Context()
    bad = session_pb2.UpdateSettingsRequest(session_id=sid, settings=common_pb2.Settings(top_p=2.0, top_k=5))
    asyncio.run(s.UpdateSettings(bad, ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    rich = ctx.rich()
    assert rich.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and rich.message == ctx.details
    found = details_of(rich)
    assert found["ErrorInfo"].reason == "INVALID_SETTING" and found["ErrorInfo"].domain == "hotloop-serve"
    assert [v.field for v in found["BadRequest"].field_violations] == ["settings.top_p"]
    assert "RetryInfo" not in found
    # An unknown session: a constant reason, nothing to retry.
    ctx = Context()
    asyncio.run(s.GetSession(session_pb2.GetSessionRequest(session_id="nope"), ctx))
    assert details_of(ctx.rich())["ErrorInfo"].reason == "SESSION_NOT_FOUND"
    # A replica going away: "retry this", with a delay.
    ctx = Context()
    set_status(ctx, Unavailable("the engine is shutting down"))
    retry = details_of(ctx.rich())["RetryInfo"]
    assert retry.retry_delay.ToMilliseconds() == 200
    # A bug: INTERNAL, no BadRequest, no RetryInfo.
    ctx = Context()
    set_status(ctx, KeyError("bug"))
    assert set(details_of(ctx.rich())) == {"ErrorInfo"} and ctx.rich().code == grpc.StatusCode.INTERNAL.value[0]
