"""One Generate through the servicer: the span tree, its attributes and the metrics match usage."""

from __future__ import annotations

import asyncio
import io
import json
import re
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
from opentelemetry.trace import SpanKind

from hotloop_serve.config import Config
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.serve.auth import Authenticator
from hotloop_serve.serve.servicer import ModelServicer
from hotloop_serve.serve.session_ids import SessionIds
from hotloop_serve.telemetry import Telemetry, configure_request_log
from hotloop_serve.telemetry.request_log import format_line

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


def _points(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, Any] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points[m.name] = m.data.data_points
    return points


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
    rpc = dict(gen.attributes or {})
    assert rpc["gen_ai.request.model"] == "tiny" and rpc["hotloop.replica"] == "r0"
    assert rpc["rpc.grpc.status_code"] == "OK" and rpc["hotloop.time_to_first_token_ms"] > 0
    assert str(rpc["gen_ai.conversation.id"]).startswith("key-12345.")
    assert "hotloop.session_id" not in rpc and "hotloop.model" not in rpc

    # The GenAI inference span: INTERNAL, named "{operation} {model}", child of the RPC span.
    chat_span = finished["chat tiny"]
    assert chat_span.kind == SpanKind.INTERNAL
    assert chat_span.parent is not None and chat_span.parent.span_id == gen.context.span_id
    attrs = dict(chat_span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "hotloop"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.conversation.id"] == rpc["gen_ai.conversation.id"]
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == usage.cached_tokens + usage.restored_tokens
    assert attrs["hotloop.tokens.prefilled"] == usage.prefilled_tokens
    assert attrs["hotloop.tokens.reused"] == usage.cached_tokens
    assert attrs["hotloop.tokens.restored"] == usage.restored_tokens
    reason = {common_pb2.FINISH_REASON_EOS: "eos", common_pb2.FINISH_REASON_LENGTH: "length"}[chunks[-1].finish_reason]
    assert attrs["hotloop.finish_reason"] == reason
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ({"eos": "stop", "length": "length"}[reason],)
    for child in ("hotloop.queue", "hotloop.prefill", "hotloop.decode"):
        assert finished[child].parent is not None and finished[child].parent.span_id == chat_span.context.span_id
    assert finished["hotloop.v1.SessionService/CreateSession"].context.trace_id == gen.context.trace_id

    points = _points(reader)
    assert sum(p.value for p in points["hotloop.tokens.generated"]) == usage.completion_tokens
    assert sum(p.value for p in points["hotloop.tokens.prefilled"]) == usage.prefilled_tokens
    genai = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "hotloop", "gen_ai.request.model": "tiny"}
    for name in ("gen_ai.server.time_to_first_token", "gen_ai.server.request.duration"):
        (point,) = points[name]
        assert point.count == 1 and genai.items() <= dict(point.attributes).items(), name
    (tpot,) = points["gen_ai.server.time_per_output_token"]
    assert tpot.count == 1 and tpot.sum > 0
    assert {"hotloop.sessions.hot", "hotloop.queue.depth", "hotloop.kv.tokens"} <= set(points)
    for name, metric_points in points.items():
        for p in metric_points:
            assert dict(p.attributes)["gen_ai.request.model"] == "tiny", name


def test_warmup_is_a_genai_span_without_output(
    traced: tuple[ModelServicer, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    servicer, spans, reader = traced

    async def run() -> session_pb2.WarmupResponse:
        ctx = Context([])
        create = session_pb2.CreateSessionRequest(model="tiny", session_key="key-67890")
        session = await servicer.CreateSession(create, ctx)
        msgs = [common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content="be brief")]
        return await servicer.Warmup(session_pb2.WarmupRequest(session_id=session.id, messages=msgs), ctx)

    reply = asyncio.run(run())
    finished = {s.name: s for s in spans.get_finished_spans()}
    attrs = dict(finished["warmup tiny"].attributes or {})
    assert attrs["gen_ai.operation.name"] == "warmup" and attrs["gen_ai.provider.name"] == "hotloop"
    assert attrs["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens > 0
    assert attrs["gen_ai.usage.output_tokens"] == 0
    assert "gen_ai.response.finish_reasons" not in attrs and "gen_ai.request.stream" not in attrs
    (duration,) = _points(reader)["gen_ai.server.request.duration"]
    point = dict(duration.attributes)
    assert point["gen_ai.operation.name"] == "warmup" and "error.type" not in point


def test_every_genai_name_is_defined_by_the_pinned_semantic_conventions() -> None:
    """Names of the gen_ai.* namespace are the conventions': none is invented here."""
    from opentelemetry.semconv._incubating.attributes import error_attributes, gen_ai_attributes
    from opentelemetry.semconv._incubating.metrics import gen_ai_metrics

    from hotloop_serve.telemetry import semconv

    defined = {
        v
        for module in (gen_ai_attributes, gen_ai_metrics, error_attributes)
        for k, v in vars(module).items()
        if k.isupper() and isinstance(v, str)
    }
    ours = {v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str) and v.startswith("gen_ai.")}
    assert len(ours) >= 13
    assert ours <= defined, ours - defined
    assert "chat" in {v.value for v in gen_ai_attributes.GenAiOperationNameValues}


def test_request_log_is_one_json_line_per_rpc_with_the_trace_id_and_no_prompt(
    tiny_model: Path,
) -> None:
    stream = io.StringIO()
    config = Config.model_validate({"models": [{"name": "tiny", "path": str(tiny_model)}]})
    with Engine(str(tiny_model), EngineOptions(context_tokens=2048, session_context_tokens=1024, hot_sessions=2)) as e:
        telemetry = Telemetry("tiny", "r0", e.stats, request_log="json")  # no tracer provider: ids still logged
        configure_request_log("json", stream)
        servicer = ModelServicer(
            config, config.models[0], e, SessionIds(b"k", "tiny"), Authenticator({}), telemetry, "r0", 0
        )
        try:
            chunks = asyncio.run(chat(servicer, Context([("traceparent", TRACEPARENT)])))
            bad = session_pb2.GenerateRequest(session_id="nope.nope")

            async def fail() -> None:
                with pytest.raises(Exception, match="not found"):
                    _ = [c async for c in servicer.Generate(bad, Context([]))]

            asyncio.run(fail())
        finally:
            configure_request_log("off")
    lines = stream.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["rpc.method"] for r in records] == ["CreateSession", "Generate", "Generate"]
    create, gen, failed = records
    usage = chunks[-1].usage
    assert create["trace_id"] == gen["trace_id"] == TRACE_ID
    assert gen["rpc.grpc.status_code"] == "OK" and gen["duration_ms"] > 0
    assert gen["gen_ai.operation.name"] == "chat" and gen["gen_ai.request.model"] == "tiny"
    assert gen["gen_ai.conversation.id"].startswith("key-12345.")
    assert gen["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert gen["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert gen["gen_ai.response.finish_reasons"] in (["stop"], ["length"])
    assert gen["hotloop.time_to_first_token_ms"] > 0
    assert failed["rpc.grpc.status_code"] == "NOT_FOUND" and "trace_id" not in failed
    assert "hello there" not in stream.getvalue()  # the prompt
    reply = "".join(c.text for c in chunks)
    assert not reply.strip() or reply not in stream.getvalue()


def test_request_log_text_format_is_logfmt() -> None:
    from datetime import UTC, datetime

    line = format_line(
        "text",
        {"rpc.method": "Generate", "duration_ms": 12.5, "gen_ai.response.finish_reasons": ["stop"], "x": None},
        now=datetime(2026, 12, 3, 10, 0, tzinfo=UTC),
    )
    assert line == (
        "time=2026-12-03T10:00:00.000Z level=info logger=hotloop_serve.requests msg=rpc "
        "rpc.method=Generate duration_ms=12.5 gen_ai.response.finish_reasons=stop"
    )


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
    (duration,) = _points(reader)["gen_ai.server.request.duration"]
    assert dict(duration.attributes)["error.type"] == "NOT_FOUND"


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
        Telemetry("tiny", "r0", None, None, meter_provider).generated.add(5, {"gen_ai.request.model": "tiny"})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "hotloop_tokens_generated" in body
        meter_provider.shutdown()
    finally:
        setup._configured = saved


def test_a_taken_prometheus_port_leaves_the_replica_serving_without_metrics() -> None:
    import socket

    from hotloop_serve.telemetry import setup

    saved = setup._configured
    setup._configured = None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
               "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_TRACES_EXPORTER": "none"}  # fmt: skip
        try:
            assert setup.configure_telemetry(env=env) == (None, None)
        finally:
            setup._configured = saved


# --------------------------------------------------------------------------- the Grafana dashboard

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "hotloop-serve" / "files" / "grafana-dashboard.json"
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s*,\s*(\w+)\s*\)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_VARIABLE = re.compile(r"\$(?:\{)?([a-zA-Z_][a-zA-Z0-9_]*)")
_BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__all"}


def exposed_series() -> dict[str, set[str]]:
    """Prometheus metric name -> label names, as the OpenTelemetry Prometheus exporter exposes what
    Telemetry records along its public paths (a served Generate, a failed one, the engine gauges)."""
    from types import SimpleNamespace

    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, generate_latest

    from hotloop_serve.engine.stream import Chunk, Timings, Usage
    from hotloop_serve.errors import NotFound
    from hotloop_serve.telemetry import semconv

    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    stats = SimpleNamespace(**{field: 1 for _, field, _ in semconv.GAUGES})
    telemetry = Telemetry("m", "r0", lambda: stats, None, provider)
    usage = Usage(prompt_tokens=10, cached_tokens=3, restored_tokens=1, prefilled_tokens=6, completion_tokens=5)
    for method in ("Generate", "Warmup"):
        with telemetry.rpc(method, None) as span:
            telemetry.first_token(span, 0.01)
            final = Chunk(finish_reason="eos", usage=usage, timings=Timings(1, 2, 3, 4), cache_hit=True)
            telemetry.record_usage(span, final, method)
    with pytest.raises(NotFound), telemetry.rpc("Generate", None):
        raise NotFound("no such session")
    series: dict[str, set[str]] = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = {kv.split("=", 1)[0] for kv in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*="[^"]*")', rest)}
            series.setdefault(name.split(" ")[0], set()).update(labels)
    provider.shutdown()
    return series


def _balanced(text: str) -> bool:
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    quoted = False
    for c in text:
        if c == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif c in "([{":
            stack.append(c)
        elif c in pairs and (not stack or stack.pop() != pairs[c]):
            return False
    return not stack and not quoted


def test_dashboard_is_a_grafana_dashboard_model() -> None:
    """The structure Grafana's dashboard JSON model requires (no JSON schema of it ships offline):
    identity, a non-overlapping 24-column grid, unique panel ids and refIds, Prometheus targets
    through the dashboard's datasource variable, and only defined variables in queries."""
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["title"], str) and dash["title"]
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dash["uid"])
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert {"from", "to"} <= set(dash["time"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    defined = set(variables) | _BUILTIN_VARIABLES
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    graphs = 0
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] >= 0 and g["w"] >= 1 and g["h"] >= 1
        assert g["x"] + g["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        assert panel["type"] in {"row", "timeseries", "stat", "gauge", "bargauge", "table"}
        if panel["type"] == "row":
            continue
        graphs += 1
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert isinstance(panel["fieldConfig"]["defaults"]["unit"], str)
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"] and _balanced(target["expr"]), target["expr"]
            assert set(_VARIABLE.findall(target["expr"])) <= defined, target["expr"]
    assert graphs >= 10
    for var in variables.values():
        if var["type"] == "query":
            assert set(_VARIABLE.findall(var["definition"])) <= defined


def test_every_dashboard_query_names_metrics_and_labels_we_emit() -> None:
    series = exposed_series()
    dash = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    used: set[str] = set()
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            match = _LABEL_VALUES.fullmatch(var["definition"])
            assert match, var["definition"]
            metric, matchers, label = match.groups()
            assert metric in series and label in series[metric], var["definition"]
            assert set(_MATCHER_LABEL.findall(matchers or "")) <= series[metric]
    for expr in queries:
        selectors = _SELECTOR.findall(expr)
        assert selectors, f"no metric in {expr!r}"
        labels_here: set[str] = {"le"}
        for metric, matchers in selectors:
            assert metric in series, f"{metric} is not a metric hotloop-serve emits (query {expr!r})"
            used.add(metric)
            labels_here |= series[metric]
            assert set(_MATCHER_LABEL.findall(matchers)) <= series[metric], (metric, matchers)
        for group in _BY.findall(expr):
            assert {label.strip() for label in group.split(",")} <= labels_here, (group, expr)
    # the panels: tokens/s, TTFT and inter-token latency, cache reuse, queue, KV, evictions
    for metric in (
        "hotloop_tokens_generated_total",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "gen_ai_server_time_per_output_token_seconds_bucket",
        "hotloop_cache_reuse_ratio_sum",
        "hotloop_queue_depth",
        "hotloop_kv_tokens",
        "hotloop_kv_evicted_bytes",
        "hotloop_sessions_evicted",
    ):
        assert metric in used, metric
