"""Telemetry through the full stack: a real OTLP receiver on loopback, health, reflection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
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
                    self.metrics.update(m.name for m in sm.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()


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
            "telemetry": server.config.telemetry.model_copy(update={"enabled": True}),
        }
    )
    serve.run(model_app(config, model, "secret"), name=OTEL_APP, route_prefix=f"/{OTEL_APP}")
    try:
        tracer = TracerProvider().get_tracer("test")
        with Client(server.address) as client, tracer.start_as_current_span("user-turn") as parent:
            session = client.model(OTEL_APP).new_session(settings=Settings(temperature=0, sample_len=8))
            final = list(session.generate([Message(Role.USER, "Hello!")]))[-1]
        trace_id = parent.get_span_context().trace_id
        deadline = time.monotonic() + 60
        wanted = {"hotloop.time_to_first_token", "hotloop.tokens.generated", "hotloop.sessions.hot"}
        while time.monotonic() < deadline:
            with receiver.lock:
                mine = [s for s in receiver.spans if int.from_bytes(s.trace_id, "big") == trace_id]
                if {"hotloop.v1.SessionService/Generate", "hotloop.decode"} <= {s.name for s in mine} and (
                    wanted <= receiver.metrics
                ):
                    break
            time.sleep(0.2)
        names = {s.name for s in mine}
        assert {"hotloop.v1.SessionService/CreateSession", "hotloop.v1.SessionService/Generate"} <= names
        assert {"hotloop.queue", "hotloop.prefill", "hotloop.decode"} <= names
        gen = next(s for s in mine if s.name.endswith("/Generate"))
        attrs = {a.key: a.value for a in gen.attributes}
        assert final.usage is not None
        assert attrs["hotloop.tokens.generated"].int_value == final.usage.completion_tokens
        assert wanted <= receiver.metrics
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
