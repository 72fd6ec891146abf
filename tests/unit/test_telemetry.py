"""One Generate through the servicer: the span tree, its attributes and the metrics match usage."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hotloop.v1 import common_pb2, session_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hotloop_serve.config import Config
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.serve.auth import Authenticator
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.session_ids import SessionIds
from hotloop_serve.telemetry import Telemetry

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Context:
    """The two things the servicer reads from Ray Serve's gRPC context: metadata and status."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = metadata
        self.code: Any = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_code(self, code: Any) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@pytest.fixture
def traced(tiny_model: Path) -> Iterator[tuple[ModelServicer, InMemorySpanExporter, InMemoryMetricReader]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    config = Config.model_validate({"models": [{"name": "tiny", "path": str(tiny_model)}]})
    with Engine(str(tiny_model), EngineOptions(context_tokens=2048, session_context_tokens=1024, hot_sessions=2)) as e:
        telemetry = Telemetry("tiny", "r0", e.stats, tracer_provider, meter_provider)
        servicer = ModelServicer(
            config, config.models[0], e, SessionIds(b"k", "tiny"), Authenticator({}), telemetry, "r0", 0
        )
        yield servicer, spans, reader


async def chat(servicer: ModelServicer, ctx: Context) -> list[session_pb2.GenerateChunk]:
    session = await servicer.CreateSession(session_pb2.CreateSessionRequest(model="tiny", session_key="key-12345"), ctx)
    msgs = [common_pb2.Message(role=common_pb2.ROLE_USER, content="hello there")]
    request = session_pb2.GenerateRequest(session_id=session.id, messages=msgs, settings={"sample_len": 9})
    return [c async for c in servicer.Generate(request, ctx)]


def test_generate_span_tree_attributes_and_metrics(
    traced: tuple[ModelServicer, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    servicer, spans, reader = traced
    chunks = asyncio.run(chat(servicer, Context([("traceparent", TRACEPARENT)])))
    usage = chunks[-1].usage
    finished = {s.name: s for s in spans.get_finished_spans()}
    gen = finished["hotloop.v1.SessionService/Generate"]
    assert format(gen.context.trace_id, "032x") == TRACE_ID  # continued from the caller
    assert gen.parent is not None and format(gen.parent.span_id, "016x") == "00f067aa0ba902b7"
    attrs = dict(gen.attributes or {})
    assert attrs["hotloop.tokens.prompt"] == usage.prompt_tokens
    assert attrs["hotloop.tokens.generated"] == usage.completion_tokens
    assert attrs["hotloop.tokens.prefilled"] == usage.prefilled_tokens
    assert attrs["hotloop.tokens.reused"] == usage.cached_tokens
    assert attrs["hotloop.model"] == "tiny" and attrs["hotloop.replica"] == "r0"
    assert attrs["rpc.grpc.status_code"] == "OK" and attrs["hotloop.time_to_first_token_ms"] > 0
    assert str(attrs["hotloop.session_id"]).startswith("key-12345.")
    for child in ("hotloop.queue", "hotloop.prefill", "hotloop.decode"):
        assert finished[child].parent is not None and finished[child].parent.span_id == gen.context.span_id
    assert finished["hotloop.v1.SessionService/CreateSession"].context.trace_id == gen.context.trace_id

    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, Any] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points[m.name] = m.data.data_points
    assert sum(p.value for p in points["hotloop.tokens.generated"]) == usage.completion_tokens
    assert sum(p.value for p in points["hotloop.tokens.prefilled"]) == usage.prefilled_tokens
    assert sum(p.count for p in points["hotloop.time_to_first_token"]) == 1
    assert {"hotloop.sessions.hot", "hotloop.queue.depth", "hotloop.kv.tokens"} <= set(points)


def test_errors_are_counted_by_status_code(
    traced: tuple[ModelServicer, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    servicer, spans, reader = traced
    ctx = Context([])
    request = session_pb2.GenerateRequest(session_id="nope.nope")

    async def run() -> None:
        with pytest.raises(Exception, match="not found"):
            _ = [c async for c in servicer.Generate(request, ctx)]

    asyncio.run(run())
    assert ctx.code is not None and ctx.code.name == "NOT_FOUND"
    gen = next(s for s in spans.get_finished_spans() if s.name.endswith("/Generate"))
    assert dict(gen.attributes or {})["rpc.grpc.status_code"] == "NOT_FOUND"
    data = reader.get_metrics_data()
    assert data is not None
    errors = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "hotloop.rpc.errors"
        for p in m.data.data_points
    ]
    assert errors and dict(errors[0].attributes)["rpc.grpc.status_code"] == "NOT_FOUND"


def test_prometheus_exporter_serves_metrics_for_scraping(tiny_model: Path) -> None:
    import urllib.request

    from conftest import free_port
    from opentelemetry.sdk.metrics import MeterProvider as Provider

    from hotloop_serve.telemetry import setup

    port = free_port()
    saved = setup._configured
    setup._configured = None
    try:
        env = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
               "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_TRACES_EXPORTER": "none"}  # fmt: skip
        _, meter_provider = setup.configure_telemetry(env=env)
        assert isinstance(meter_provider, Provider)
        Telemetry("tiny", "r0", None, None, meter_provider).generated.add(5, {"hotloop.model": "tiny"})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "hotloop_tokens_generated" in body
        meter_provider.shutdown()
    finally:
        setup._configured = saved
