"""Exporter set-up from the standard OTEL_* environment variables.

Nothing is exported by default. ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` choose
``otlp`` or ``console`` (``none`` to disable); setting ``OTEL_EXPORTER_OTLP_ENDPOINT`` alone
turns OTLP on for both. ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``grpc`` (default) or
``http/protobuf``; endpoint, headers, timeouts and the rest are read by the exporters
themselves. ``OTEL_METRICS_EXPORTER=prometheus`` serves the metrics for scraping instead, on
``OTEL_EXPORTER_PROMETHEUS_HOST``:``OTEL_EXPORTER_PROMETHEUS_PORT`` (default 0.0.0.0:9464; one
replica per pod, or a distinct port per replica through ``models[].env``).
``OTEL_SERVICE_NAME`` names the service (default ``hotloop-serve``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)

_configured: tuple[TracerProvider | None, MeterProvider | None] | None = None


def _choice(env: Mapping[str, str], kind: str, console: bool) -> str:
    explicit = env.get(f"OTEL_{kind}_EXPORTER")
    if explicit:
        return explicit.split(",")[0].strip().lower()
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{kind}_ENDPOINT"):
        return "otlp"
    return "console" if console else "none"


def _protocol(env: Mapping[str, str], kind: str) -> str:
    return env.get(f"OTEL_EXPORTER_OTLP_{kind}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"


def _span_exporter(env: Mapping[str, str]) -> SpanExporter:
    if _protocol(env, "TRACES").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

        return HttpSpans()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

    return GrpcSpans()


def _metric_exporter(env: Mapping[str, str]) -> Any:
    if _protocol(env, "METRICS").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

        return HttpMetrics()
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

    return GrpcMetrics()


def configure_telemetry(
    enabled: bool = True,
    console: bool = False,
    env: Mapping[str, str] | None = None,
    extra_readers: list[MetricReader] | None = None,
) -> tuple[TracerProvider | None, MeterProvider | None]:
    """Install global tracer/meter providers once per process; returns them (None = not exporting)."""
    global _configured
    if _configured is not None:
        return _configured
    env = os.environ if env is None else env
    if not enabled:
        _configured = (None, None)
        return _configured
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "hotloop-serve")})
    tracer_provider = None
    traces = _choice(env, "TRACES", console)
    if traces in ("otlp", "console"):
        tracer_provider = TracerProvider(resource=resource)
        exporter = _span_exporter(env) if traces == "otlp" else ConsoleSpanExporter()
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(tracer_provider)
    meter_provider = None
    kind = _choice(env, "METRICS", console)
    readers: list[MetricReader] = list(extra_readers or [])
    if kind == "prometheus":
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "0.0.0.0")
        port = int(env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464"))
        try:
            start_http_server(port, addr=host)
        except OSError as e:
            # Another replica of this pod holds the port: serve requests, just without metrics.
            log.warning("metrics not served: %s:%d is taken (%s); one replica per pod/port", host, port, e)
        else:
            readers.append(PrometheusMetricReader())
    elif kind in ("otlp", "console"):
        metric_exporter = _metric_exporter(env) if kind == "otlp" else ConsoleMetricExporter()
        interval = int(env.get("OTEL_METRIC_EXPORT_INTERVAL", "10000"))
        readers.append(PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval))
    if readers:
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        metrics.set_meter_provider(meter_provider)
    _configured = (tracer_provider, meter_provider)
    return _configured


def shutdown_telemetry() -> None:
    """Flush and stop exporters (replica shutdown)."""
    if _configured is None:
        return
    tp, mp = _configured
    if tp is not None:
        tp.shutdown()
    if mp is not None:
        mp.shutdown()
