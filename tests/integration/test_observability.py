"""Telemetry through the full stack: a real OTLP receiver on loopback, health, reflection."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hotloop_client import Client, Message, Role, Settings
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from ray import serve

from hotloop_serve.serve.app import model_app

from .conftest import SINGLE, Server

pytestmark = pytest.mark.integration
OTEL_APP = "gemma-otel"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.metrics: set[str] = set()
        self.points: dict[str, list[dict[str, Any]]] = {}  # metric -> data points' attributes
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        self.spans.extend(ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        self.metrics.add(m.name)
                        data = getattr(m, m.WhichOneof("data"))
                        self.points.setdefault(m.name, []).extend(attributes(p) for p in data.data_points)
            return metrics_service_pb2.ExportMetricsServiceResponse()


def value(v: Any) -> Any:
    """An OTLP AnyValue as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(item: Any) -> dict[str, Any]:
    return {a.key: value(a.value) for a in item.attributes}


def replica_log_lines(trace_hex: str) -> list[str]:
    """Request-log lines of one trace from the Ray workers' stderr files (this machine's Ray sessions)."""
    found = []
    sessions = [d for d in Path(tempfile.gettempdir(), "ray").glob("session_*") if not d.is_symlink()]  # not _latest
    for path in (p for d in sessions for p in d.glob("logs/worker-*.err")):
        with path.open(errors="replace") as f:
            found += [line for line in f if line.startswith("{") and f'"trace_id":"{trace_hex}"' in line]
    return sorted(found, key=lambda line: json.loads(line)["time"])


@pytest.fixture
def otlp() -> Iterator[tuple[Receiver, int]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(grace=None)


def test_spans_and_metrics_of_a_real_chat_reach_an_otlp_receiver(server: Server, otlp: tuple[Receiver, int]) -> None:
    receiver, port = otlp
    base = server.config.model(SINGLE)
    model = base.model_copy(
        update={
            "name": OTEL_APP,
            "env": {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_METRIC_EXPORT_INTERVAL": "500",
            },
        }
    )
    config = server.config.model_copy(
        update={
            "models": [*server.config.models, model],
            "telemetry": server.config.telemetry.model_copy(update={"enabled": True, "request_log": "json"}),
        }
    )
    serve.run(model_app(config, model, "secret"), name=OTEL_APP, route_prefix=f"/{OTEL_APP}")
    try:
        tracer = TracerProvider().get_tracer("test")
        with Client(server.address) as client, tracer.start_as_current_span("user-turn") as parent:
            session = client.model(OTEL_APP).new_session(settings=Settings(temperature=0, sample_len=8))
            history = [Message(Role.USER, "Hello!")]
            first = list(session.generate(history))
            history += [Message(Role.ASSISTANT, "".join(c.text for c in first)), Message(Role.USER, "And then?")]
            second = list(session.generate(history))  # reuses the first turn's KV cache
            session_id = session.id
        trace_id = parent.get_span_context().trace_id
        deadline = time.monotonic() + 60
        wanted = {
            "gen_ai.server.time_to_first_token",
            "gen_ai.server.time_per_output_token",
            "gen_ai.server.request.duration",
            "hotloop.tokens.generated",
            "hotloop.sessions.hot",
        }
        while time.monotonic() < deadline:
            with receiver.lock:
                mine = [s for s in receiver.spans if int.from_bytes(s.trace_id, "big") == trace_id]
                names = [s.name for s in mine]
                if names.count(f"chat {OTEL_APP}") == 2 and "hotloop.decode" in names and wanted <= receiver.metrics:
                    break
            time.sleep(0.2)
        names = [s.name for s in mine]
        assert {"hotloop.v1.SessionService/CreateSession", "hotloop.v1.SessionService/Generate"} <= set(names)
        assert {"hotloop.queue", "hotloop.prefill", "hotloop.decode"} <= set(names)
        by_id = {s.span_id: s for s in mine}
        rpcs = sorted((s for s in mine if s.name.endswith("/Generate")), key=lambda s: s.start_time_unix_nano)
        chats = sorted((s for s in mine if s.name == f"chat {OTEL_APP}"), key=lambda s: s.start_time_unix_nano)
        assert len(rpcs) == len(chats) == 2
        for rpc, chat, turn in zip(rpcs, chats, (first, second), strict=True):
            final = turn[-1]
            assert final.usage is not None and final.finish_reason is not None
            assert chat.kind == chat.SPAN_KIND_INTERNAL and by_id[chat.parent_span_id] is rpc
            attrs = attributes(chat)
            assert attrs["gen_ai.operation.name"] == "chat"
            assert attrs["gen_ai.provider.name"] == "hotloop"
            assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == OTEL_APP
            assert attrs["gen_ai.request.stream"] is True
            assert attrs["gen_ai.conversation.id"] == session_id == attributes(rpc)["gen_ai.conversation.id"]
            assert attrs["gen_ai.usage.input_tokens"] == final.usage.prompt_tokens
            assert attrs["gen_ai.usage.output_tokens"] == final.usage.completion_tokens
            cache_read = final.usage.cached_tokens + final.usage.restored_tokens
            assert attrs["gen_ai.usage.cache_read.input_tokens"] == cache_read
            assert attrs["hotloop.tokens.prefilled"] == final.usage.prefilled_tokens
            reason = final.finish_reason.value
            assert attrs["hotloop.finish_reason"] == reason
            assert attrs["gen_ai.response.finish_reasons"] == [{"eos": "stop", "context": "length"}.get(reason, reason)]
            for child in (s for s in mine if s.name in ("hotloop.queue", "hotloop.prefill", "hotloop.decode")):
                assert child.parent_span_id in {c.span_id for c in chats}
        assert attributes(chats[1])["gen_ai.usage.cache_read.input_tokens"] > 0  # the second turn hit the cache
        assert wanted <= receiver.metrics
        genai = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "hotloop", "gen_ai.request.model": OTEL_APP}
        for metric in ("gen_ai.server.time_to_first_token", "gen_ai.server.request.duration"):
            assert any(genai.items() <= p.items() for p in receiver.points[metric]), receiver.points[metric]
        assert all("hotloop.model" not in p for points in receiver.points.values() for p in points)

        # One JSON request-log line per RPC in the replica's log, carrying the trace id, never the prompt.
        trace_hex = format(trace_id, "032x")
        lines: list[dict[str, Any]] = []
        while time.monotonic() < deadline and len(lines) < 3:
            lines = [json.loads(line) for line in replica_log_lines(trace_hex)]
            time.sleep(0.2)
        assert [r["rpc.method"] for r in lines] == ["CreateSession", "Generate", "Generate"], lines
        for record, turn in zip(lines[1:], (first, second), strict=True):
            assert record["logger"] == "hotloop_serve.requests" and record["rpc.grpc.status_code"] == "OK"
            assert record["gen_ai.conversation.id"] == session_id
            assert record["gen_ai.usage.output_tokens"] == turn[-1].usage.completion_tokens
        assert not any("Hello!" in json.dumps(r) or "And then?" in json.dumps(r) for r in lines)
    finally:
        serve.delete(OTEL_APP)
    assert trace.get_tracer_provider() is not None


def test_health_answers_serving(server: Server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(), metadata=[("application", SINGLE)], timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        svc = health_pb2.HealthCheckRequest(service="hotloop.v1.SessionService")
        assert stub.Check(svc, metadata=[("application", SINGLE)]).status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lets_a_stock_client_discover_every_rpc(server: Server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"hotloop.v1.SessionService", "hotloop.v1.ModelService", "grpc.health.v1.Health"} <= services
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        session = pool.FindServiceByName("hotloop.v1.SessionService")
        methods = {m.name for m in session.methods}
        assert {"CreateSession", "Generate", "Warmup", "GetSession", "UpdateSettings", "ClearCache"} <= methods
        assert session.FindMethodByName("Generate").server_streaming
