"""The SDK against a real in-process gRPC server speaking the hotloop protos.

The server is a scripted fake of the SessionService/ModelService (plus Ray Serve's
ListApplications), so each test can make the "replica" fail exactly where it wants:
before the first chunk, after some text, on a unary call. What the client sends (requests
and metadata) is recorded and asserted, which pins the wire contract the server relies on.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hotloop.v1 import common_pb2, model_pb2, model_pb2_grpc, session_pb2, session_pb2_grpc
from hotloop_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    FinishReason,
    HotloopError,
    InternalError,
    InvalidArgument,
    Message,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Role,
    Settings,
    Tool,
    ToolCall,
    TurnInterrupted,
    Unauthenticated,
    Unavailable,
    assistant_message,
)
from hotloop_client._base import DEFAULT_UNARY_TIMEOUT_S, MAX_ATTEMPTS, MAX_RETRY_DELAY_S, BaseClient, backoff

MODEL = "gemma-3-270m"
ACTOR_DIED = "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."


def _apps_response_class() -> Any:
    """Ray Serve's ListApplicationsResponse, built from a descriptor (importing Ray is slow)."""
    fdp = descriptor_pb2.FileDescriptorProto(name="fake_ray_serve.proto", package="fakeray", syntax="proto3")
    msg = fdp.message_type.add(name="ListApplicationsResponse")
    msg.field.add(
        name="application_names",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fakeray.ListApplicationsResponse"))


AppsResponse = _apps_response_class()


@dataclass
class Call:
    method: str
    request: Any
    metadata: dict[str, str]


def _last_chunk() -> Any:
    return session_pb2.GenerateChunk(
        finish_reason=common_pb2.FINISH_REASON_EOS,
        usage=common_pb2.Usage(prompt_tokens=10, cached_tokens=4, prefilled_tokens=6, completion_tokens=2),
        timings=common_pb2.Timings(time_to_first_token_ms=12.5, decode_ms=20.0),
        served_by=common_pb2.ServedBy(replica="r1", replica_rank=1, cache_hit=True),
    )


# A Generate script is a list of steps: ("text", str) | ("abort", (code, details))
# | ("wait_cancel", None) | ("last", None).
DEFAULT_SCRIPT: list[tuple[str, Any]] = [("text", "Hello"), ("text", " world"), ("last", None)]
SERVER_DEFAULTS = common_pb2.Settings(temperature=0.8, top_k=40, sample_len=256)


@dataclass
class Recorder:
    """What the fake server saw and what it is told to do next."""

    calls: list[Call] = field(default_factory=list)
    scripts: list[list[tuple[str, Any]]] = field(default_factory=list)
    failures: dict[str, list[tuple[grpc.StatusCode, str]]] = field(default_factory=dict)
    applications: list[str] | None = field(default_factory=lambda: [MODEL, "other"])
    cancelled: threading.Event = field(default_factory=threading.Event)

    def record(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        self.calls.append(Call(method, request, dict(context.invocation_metadata())))
        pending = self.failures.get(method)
        if pending:
            context.abort(*pending.pop(0))

    def of(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]


def _filled(settings: Any) -> Any:
    pb = common_pb2.Settings()
    pb.CopyFrom(SERVER_DEFAULTS)
    pb.MergeFrom(settings)
    return pb


class FakeSessions(session_pb2_grpc.SessionServiceServicer):  # type: ignore[misc]
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def CreateSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("CreateSession", request, context)
        return session_pb2.Session(
            id=f"s-{request.session_key}", model=request.model, settings=_filled(request.settings)
        )

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.rec.record("Generate", request, context)
        script = self.rec.scripts.pop(0) if self.rec.scripts else DEFAULT_SCRIPT
        # Registered before the first yield: a cancel that lands while a chunk is still in
        # flight must be seen too. Only an end before the script finished is a cancel.
        cancelled, finished = self.rec.cancelled, threading.Event()
        context.add_callback(lambda: None if finished.is_set() else cancelled.set())
        for kind, arg in script:
            if kind == "text":
                yield session_pb2.GenerateChunk(text=arg)
            elif kind == "last":
                yield _last_chunk()
            elif kind == "chunk":
                yield arg
            elif kind == "abort":
                finished.set()
                context.abort(*arg)
            elif kind == "wait_cancel":
                cancelled.wait(5)
                return
        finished.set()

    def Warmup(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("Warmup", request, context)
        return session_pb2.WarmupResponse(usage=common_pb2.Usage(prompt_tokens=7, prefilled_tokens=7), context_tokens=7)

    def GetSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("GetSession", request, context)
        return session_pb2.Session(id=request.session_id, model=MODEL, context_tokens=123, state="hot")

    def UpdateSettings(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("UpdateSettings", request, context)
        return session_pb2.Session(id=request.session_id, model=MODEL, settings=_filled(request.settings))

    def ClearCache(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("ClearCache", request, context)
        return session_pb2.Session(id=request.session_id, model=MODEL)

    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("CloseSession", request, context)
        return session_pb2.CloseSessionResponse()


class FakeModels(model_pb2_grpc.ModelServiceServicer):  # type: ignore[misc]
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("ListModels", request, context)
        return model_pb2.ListModelsResponse(
            models=[model_pb2.ModelInfo(name=MODEL, context_length=2048, replicas=2), model_pb2.ModelInfo(name="other")]
        )

    def GetModel(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("GetModel", request, context)
        return model_pb2.ModelInfo(name=request.model, architecture="gemma3", context_length=2048)

    def Tokenize(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.rec.record("Tokenize", request, context)
        return model_pb2.TokenizeResponse(tokens=[ord(c) for c in request.text])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Recorder]]:
    rec = Recorder()

    def list_applications(request: bytes, context: grpc.ServicerContext) -> bytes:
        rec.record("ListApplications", request, context)
        if rec.applications is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return bytes(AppsResponse(application_names=rec.applications).SerializeToString())

    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    session_pb2_grpc.add_SessionServiceServicer_to_server(FakeSessions(rec), srv)
    model_pb2_grpc.add_ModelServiceServicer_to_server(FakeModels(rec), srv)
    srv.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "ray.serve.RayServeAPIService",
                {"ListApplications": grpc.unary_unary_rpc_method_handler(list_applications)},
            ),
        )
    )
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}", rec
    finally:
        srv.stop(None).wait(5)


@pytest.fixture
def fake(server: tuple[str, Recorder]) -> Iterator[tuple[str, Recorder]]:
    """The module's server with a fresh recorder state for this test."""
    address, rec = server
    fresh = Recorder()
    rec.__dict__.update(fresh.__dict__)
    yield address, rec
    assert not rec.scripts, "a scripted Generate was never called"


@pytest.fixture
def client(fake: tuple[str, Recorder]) -> Iterator[Client]:
    with Client(fake[0], retry_delay=0) as c:
        yield c


HISTORY = [Message(Role.USER, "Hi")]


# --------------------------------------------------------------------------- sync client


def test_new_session_sends_routing_key_application_and_token(fake: tuple[str, Recorder]) -> None:
    address, rec = fake
    with Client(address, token="s3cret") as client:
        session = client.model(MODEL).new_session(settings=Settings(temperature=0.7, seed=12345))
    (call,) = rec.of("CreateSession")
    assert re.fullmatch(r"[A-Za-z0-9_-]{8,64}", call.request.session_key)
    assert session.id == f"s-{call.request.session_key}"
    assert call.metadata["application"] == MODEL
    assert call.metadata["authorization"] == "Bearer s3cret"
    assert call.request.settings.seed == 12345
    # The session adopts the server's filled-in settings, float32 rounding undone.
    assert session.settings == Settings(temperature=0.7, seed=12345, top_k=40, sample_len=256)


def test_no_authorization_without_token(client: Client, fake: tuple[str, Recorder]) -> None:
    client.model(MODEL).info()
    assert "authorization" not in fake[1].calls[0].metadata


def test_generate_streams_and_sends_settings_every_turn(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session(settings=Settings(temperature=0.5))
    chunks = list(session.generate([("system", "be brief"), ("user", "Hi")], top_p=0.9))
    assert "".join(c.text for c in chunks) == "Hello world"
    last = chunks[-1]
    assert last.is_last and not chunks[0].is_last
    assert last.finish_reason is FinishReason.EOS
    assert last.usage is not None and last.usage.cached_tokens == 4
    assert last.timings is not None and last.timings.time_to_first_token_ms == 12.5
    assert last.served_by is not None and last.served_by.cache_hit
    list(session.generate(HISTORY))

    first, second = rec.of("Generate")
    assert first.request.session_id == session.id
    assert [m.role for m in first.request.messages] == [common_pb2.ROLE_SYSTEM, common_pb2.ROLE_USER]
    assert first.request.settings.top_p == pytest.approx(0.9)  # the override, this turn only
    assert first.request.settings.temperature == pytest.approx(0.5)
    assert not second.request.settings.HasField("top_p")
    assert second.request.settings.temperature == pytest.approx(0.5)
    assert second.request.settings.top_k == 40
    assert all(c.metadata["application"] == MODEL for c in rec.calls)
    # The routing key as metadata, for the session-affinity router (it never decodes requests).
    (create,) = rec.of("CreateSession")
    assert create.metadata["session_id"] == create.request.session_key
    assert first.metadata["session_id"] == second.metadata["session_id"] == session.id.split(".", 1)[0]


def test_generate_rejects_bad_input_before_any_rpc(client: Client, fake: tuple[str, Recorder]) -> None:
    session = client.model(MODEL).new_session()
    with pytest.raises(ValueError):
        session.generate([])
    with pytest.raises(ValueError):
        session.generate([("robot", "beep")])
    with pytest.raises(TypeError):
        session.generate(HISTORY, temprature=0.1)
    assert not fake[1].of("Generate")


@pytest.mark.parametrize(
    ("code", "details"),
    [(grpc.StatusCode.UNAVAILABLE, "connection reset"), (grpc.StatusCode.INTERNAL, ACTOR_DIED)],
)
def test_generate_retries_once_before_any_text(
    client: Client, fake: tuple[str, Recorder], code: grpc.StatusCode, details: str
) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.scripts = [[("abort", (code, details))], DEFAULT_SCRIPT]
    assert "".join(c.text for c in session.generate(HISTORY)) == "Hello world"
    first, second = rec.of("Generate")
    assert first.request == second.request


def test_generate_gives_up_after_max_attempts(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    down = [("abort", (grpc.StatusCode.UNAVAILABLE, "no replica"))]
    rec.scripts = [down] * MAX_ATTEMPTS
    with pytest.raises(Unavailable) as info:
        list(session.generate(HISTORY))
    assert not isinstance(info.value, TurnInterrupted)
    assert len(rec.of("Generate")) == MAX_ATTEMPTS


def test_generate_does_not_retry_a_plain_internal_error(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.scripts = [[("abort", (grpc.StatusCode.INTERNAL, "division by zero"))]]
    with pytest.raises(InternalError, match="division by zero"):
        list(session.generate(HISTORY))
    assert len(rec.of("Generate")) == 1


def test_failure_after_text_raises_turn_interrupted(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.scripts = [[("text", "Hel"), ("text", "lo"), ("abort", (grpc.StatusCode.INTERNAL, ACTOR_DIED))]]
    received: list[str] = []
    with pytest.raises(TurnInterrupted) as info:
        for chunk in session.generate(HISTORY):
            received.append(chunk.text)
    assert received == ["Hel", "lo"]
    assert info.value.partial_text == "Hello"
    assert isinstance(info.value, Unavailable)
    assert "same history" in str(info.value)
    assert len(rec.of("Generate")) == 1  # no silent retry once text was shown


def test_breaking_out_cancels_the_call_on_the_server(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.scripts = [[("text", "Hel"), ("wait_cancel", None)]]
    for chunk in session.generate(HISTORY):
        assert chunk.text == "Hel"
        break
    assert rec.cancelled.wait(2)


def test_timeout_is_a_grpc_deadline(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.scripts = [[("wait_cancel", None)]]
    with pytest.raises(DeadlineExceeded):
        list(session.generate(HISTORY, timeout=0.2))
    assert rec.cancelled.wait(2)


def test_unary_calls_retry_on_failover_up_to_max_attempts(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session()
    rec.failures["GetSession"] = [(grpc.StatusCode.INTERNAL, ACTOR_DIED), (grpc.StatusCode.UNAVAILABLE, "restarting")]
    assert session.context() == 123
    assert len(rec.of("GetSession")) == 3
    rec.failures["GetSession"] = [(grpc.StatusCode.UNAVAILABLE, "down")] * MAX_ATTEMPTS
    with pytest.raises(Unavailable):
        session.context()
    assert len(rec.of("GetSession")) == 3 + MAX_ATTEMPTS


def test_backoff_doubles_with_jitter_up_to_a_cap() -> None:
    lows = [backoff(0.2, a, rng=lambda: 0.0) for a in range(1, 8)]
    highs = [backoff(0.2, a, rng=lambda: 1.0) for a in range(1, 8)]
    assert highs[:5] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2]) and highs[5:] == [MAX_RETRY_DELAY_S] * 2
    assert lows == pytest.approx([h / 2 for h in highs])  # half fixed, half random
    # The default schedule covers a proxy or replica restart of a few seconds, and no more.
    assert sum(lows[: MAX_ATTEMPTS - 1]) >= 3.0 and sum(highs[: MAX_ATTEMPTS - 1]) <= 6.5


def test_unary_calls_get_a_default_deadline() -> None:
    base = BaseClient("h:1")
    remaining = base.deadline(None, unary=True).remaining()
    assert remaining is not None and DEFAULT_UNARY_TIMEOUT_S - 1 < remaining <= DEFAULT_UNARY_TIMEOUT_S
    assert base.deadline(None).remaining() is None  # a stream: a reply may be long
    assert BaseClient("h:1", timeout=5).deadline(None, unary=True).remaining() == pytest.approx(5, abs=0.5)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.OUT_OF_RANGE, OutOfRange),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        (grpc.StatusCode.UNIMPLEMENTED, HotloopError),
    ],
)
def test_statuses_become_typed_errors(
    client: Client, fake: tuple[str, Recorder], code: grpc.StatusCode, error: type[HotloopError]
) -> None:
    fake[1].failures["GetModel"] = [(code, "nope")]
    with pytest.raises(error) as info:
        client.model(MODEL).info()
    assert info.value.code == code
    assert info.value.details == "nope"
    assert len(fake[1].of("GetModel")) == 1  # not retried


def test_session_management_calls(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    session = client.model(MODEL).new_session(settings=Settings(seed=1))
    usage = session.warmup([Message(Role.SYSTEM, "always answer in json!")])
    assert usage.prompt_tokens == 7
    (warmup,) = rec.of("Warmup")
    assert warmup.request.settings.seed == 1  # settings ride along, for a rebuilt session
    assert session.info().state == "hot"

    new = session.set_settings(Settings(temperature=0.1))
    assert new == session.settings == Settings(temperature=0.1, top_k=40, sample_len=256)
    list(session.generate(HISTORY))
    assert not rec.of("Generate")[0].request.settings.HasField("seed")

    session.clear_cache()
    assert rec.of("ClearCache")[0].request.session_id == session.id
    rec.failures["CloseSession"] = [(grpc.StatusCode.NOT_FOUND, "gone")]
    with session:
        pass  # __exit__ closes; NOT_FOUND (already gone) counts as closed
    session.close()
    assert len(rec.of("CloseSession")) == 1


def test_list_models_routes_by_the_first_application(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    models = client.list_models()
    assert [m.name for m in models] == [MODEL, "other"]
    assert models[0].context_length == 2048
    (apps,) = rec.of("ListApplications")
    assert "application" not in apps.metadata
    assert rec.of("ListModels")[0].metadata["application"] == MODEL
    assert client.model(MODEL).tokenize("ab") == [97, 98]


def test_list_models_without_ray_proxy_or_apps(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    rec.applications = None
    assert len(client.list_models()) == 2
    assert "application" not in rec.of("ListModels")[0].metadata
    rec.applications = []
    assert client.list_models() == []


def test_trace_context_is_propagated(client: Client, fake: tuple[str, Recorder]) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("turn") as span:
        client.model(MODEL).info()
        trace_id = format(span.get_span_context().trace_id, "032x")
    client.model(MODEL).info()
    with_span, without_span = fake[1].of("GetModel")
    assert trace_id in with_span.metadata["traceparent"]
    assert "traceparent" not in without_span.metadata


def test_unreachable_server_is_unavailable() -> None:
    with Client("127.0.0.1:1", retry_delay=0, timeout=2) as client, pytest.raises(Unavailable):
        client.model(MODEL).info()


# --------------------------------------------------------------------------- asyncio client


def test_async_session_round_trip(fake: tuple[str, Recorder]) -> None:
    address, rec = fake

    async def main() -> None:
        async with AsyncClient(address, token="t", retry_delay=0) as client:
            assert [m.name for m in await client.list_models()] == [MODEL, "other"]
            assert (await client.model(MODEL).info()).architecture == "gemma3"
            async with await client.model(MODEL).new_session(settings=Settings(seed=3)) as session:
                assert (await session.warmup(HISTORY)).prompt_tokens == 7
                text = [c.text async for c in session.generate(HISTORY, temperature=0)]
                assert "".join(text) == "Hello world"
                assert await session.context() == 123
                await session.set_settings(Settings(top_p=0.5))
                await session.clear_cache()

    asyncio.run(main())
    (gen,) = rec.of("Generate")
    assert gen.request.settings.seed == 3 and gen.request.settings.temperature == 0
    assert gen.metadata["authorization"] == "Bearer t"
    assert len(rec.of("CloseSession")) == 1


def test_async_retry_and_turn_interrupted(fake: tuple[str, Recorder]) -> None:
    address, rec = fake

    async def main() -> None:
        async with AsyncClient(address, retry_delay=0) as client:
            session = await client.model(MODEL).new_session()
            rec.scripts = [
                [("abort", (grpc.StatusCode.UNAVAILABLE, "replica restarting"))],
                DEFAULT_SCRIPT,
                [("text", "Hel"), ("abort", (grpc.StatusCode.UNAVAILABLE, "replica gone"))],
            ]
            assert "".join([c.text async for c in session.generate(HISTORY)]) == "Hello world"
            with pytest.raises(TurnInterrupted) as info:
                async for _ in session.generate(HISTORY):
                    pass
            assert info.value.partial_text == "Hel"
            rec.failures["UpdateSettings"] = [(grpc.StatusCode.UNAVAILABLE, "x")]
            await session.set_settings(Settings(top_k=1))

    asyncio.run(main())
    assert len(rec.of("Generate")) == 3
    assert len(rec.of("UpdateSettings")) == 2


def test_async_aclose_and_task_cancel_cancel_the_call(fake: tuple[str, Recorder]) -> None:
    address, rec = fake

    async def main() -> None:
        async with AsyncClient(address, retry_delay=0) as client:
            session = await client.model(MODEL).new_session()
            rec.scripts = [[("text", "Hel"), ("wait_cancel", None)]]
            stream = session.generate(HISTORY)
            assert (await anext(stream)).text == "Hel"
            await stream.aclose()
            assert await asyncio.to_thread(rec.cancelled.wait, 2)

            rec.cancelled.clear()
            rec.scripts = [[("wait_cancel", None)]]

            async def consume() -> None:
                async for _ in session.generate(HISTORY):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(rec.cancelled.wait, 2)

            rec.failures["GetSession"] = [(grpc.StatusCode.NOT_FOUND, "no such session")]
            with pytest.raises(NotFound):
                await session.context()

    asyncio.run(main())


def test_tools_go_with_the_turn_and_calls_come_back_as_deltas(client: Client, fake: tuple[str, Recorder]) -> None:
    rec = fake[1]
    delta = common_pb2.ToolCallDelta
    rec.scripts.append(
        [
            ("chunk", session_pb2.GenerateChunk(tool_calls=[delta(index=0, id="call_1", name="f", arguments='{"a"')])),
            ("chunk", session_pb2.GenerateChunk(tool_calls=[delta(index=0, arguments=": 1}")])),
            ("chunk", session_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS)),
        ]
    )
    session = client.model(MODEL).new_session()
    tool = Tool("f", "a function", {"type": "object", "properties": {"a": {"type": "integer"}}})
    chunks = list(session.generate(HISTORY, tools=[tool], tool_choice="f", parallel_tool_calls=False))
    assert chunks[-1].finish_reason is FinishReason.TOOL_CALLS
    reply = assistant_message(chunks)
    assert reply == Message(Role.ASSISTANT, "", (ToolCall("call_1", "f", '{"a": 1}'),))
    history = [*HISTORY, reply, Message(Role.TOOL, "2", tool_call_id="call_1")]
    list(session.generate(history))
    first, second = rec.of("Generate")
    assert [t.name for t in first.request.tools] == ["f"] and first.request.tool_choice == "f"
    assert json.loads(first.request.tools[0].parameters)["properties"]["a"] == {"type": "integer"}
    assert first.request.HasField("parallel_tool_calls") and not first.request.parallel_tool_calls
    assert not second.request.tools and not second.request.HasField("parallel_tool_calls")
    sent = second.request.messages
    assert sent[-2].tool_calls[0].arguments == '{"a": 1}' and sent[-1].role == common_pb2.ROLE_TOOL
    assert sent[-1].tool_call_id == "call_1"
