"""The spans and instruments of one replica.

One span per RPC (continued from the caller's W3C ``traceparent``), with children for
queueing, prefill and decode created after the fact from the request's timings: nothing
runs per token. Metrics go through the OpenTelemetry API, so with no provider installed
(the default) every call is a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from hotloop_serve.engine.stream import Chunk
from hotloop_serve.errors import HotloopError

_SERVICES = {
    "ListModels": "hotloop.v1.ModelService",
    "GetModel": "hotloop.v1.ModelService",
    "Tokenize": "hotloop.v1.ModelService",
}
_MS = 1e-3
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Telemetry:
    """Tracer + meter for one model replica; ``stats`` feeds the engine gauges."""

    def __init__(
        self,
        model: str,
        replica: str,
        stats: Callable[[], Any] | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        self.model = model
        self.replica = replica
        self.tracer = trace.get_tracer("hotloop_serve", tracer_provider=tracer_provider)
        meter = metrics.get_meter("hotloop_serve", meter_provider=meter_provider)
        self._attrs = {"hotloop.model": model, "hotloop.replica": replica}
        self.ttft = meter.create_histogram(
            "hotloop.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS
        )
        self.itl = meter.create_histogram(
            "hotloop.inter_token_latency", unit="s", explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS
        )
        self.generated = meter.create_counter("hotloop.tokens.generated", unit="{token}")
        self.prefilled = meter.create_counter("hotloop.tokens.prefilled", unit="{token}")
        self.reused = meter.create_counter("hotloop.tokens.reused", unit="{token}")
        self.reuse_ratio = meter.create_histogram("hotloop.cache.reuse_ratio", unit="1")
        self.affinity = meter.create_counter("hotloop.affinity.requests", unit="{request}")
        self.errors = meter.create_counter("hotloop.rpc.errors", unit="{request}")
        self._stats = stats
        if stats is not None:
            for name, field, unit in (
                ("hotloop.sessions.active", "active_requests", "{session}"),
                ("hotloop.sessions.hot", "hot_sessions", "{session}"),
                ("hotloop.sessions.evicted", "evicted_sessions", "{session}"),
                ("hotloop.sessions.total", "sessions", "{session}"),
                ("hotloop.kv.evicted_bytes", "evicted_bytes", "By"),
                ("hotloop.kv.tokens", "kv_tokens", "{token}"),
                ("hotloop.queue.depth", "waiting_requests", "{request}"),
            ):
                meter.create_observable_gauge(name, callbacks=[self._gauge(field)], unit=unit)

    def _gauge(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            assert self._stats is not None
            yield Observation(getattr(self._stats(), field), self._attrs)

        return observe

    @contextmanager
    def rpc(self, method: str, grpc_context: Any) -> Iterator[Span]:
        """A SERVER span for one RPC, child of the caller's trace context when it sent one."""
        carrier: dict[str, str] = {}
        if grpc_context is not None:
            for k, v in grpc_context.invocation_metadata() or ():
                if k in ("traceparent", "tracestate"):
                    carrier[k] = v.decode() if isinstance(v, bytes) else v
        parent = propagate.extract(carrier) if carrier else None
        service = _SERVICES.get(method, "hotloop.v1.SessionService")
        # Not "current": the span lives across an async generator's yields, where a context
        # variable set on entry could be reset from another context.
        span = self.tracer.start_span(
            f"{service}/{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **self._attrs},
        )
        try:
            yield span
        except HotloopError as e:
            self._error(span, method, e.code, e.message)
            raise
        except BaseException as e:
            cancelled = isinstance(e, GeneratorExit) or type(e).__name__ == "CancelledError"
            self._error(span, method, "CANCELLED" if cancelled else "INTERNAL", str(e) or type(e).__name__)
            raise
        else:
            span.set_attribute("rpc.grpc.status_code", "OK")
        finally:
            span.end()

    def _error(self, span: Span, method: str, code: str, message: str) -> None:
        span.set_attribute("rpc.grpc.status_code", code)
        span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
        self.errors.add(1, {**self._attrs, "rpc.method": method, "rpc.grpc.status_code": code})

    def first_token(self, span: Span, seconds: float) -> None:
        span.set_attribute("hotloop.time_to_first_token_ms", seconds * 1e3)
        self.ttft.record(seconds, self._attrs)

    def record_usage(self, span: Span, final: Chunk, method: str) -> None:
        """Attributes, child spans (queue, prefill, decode) and metrics from a request's final chunk."""
        u, t = final.usage, final.timings
        if u is None or t is None:
            return
        span.set_attributes(
            {
                "hotloop.tokens.prompt": u.prompt_tokens,
                "hotloop.tokens.reused": u.cached_tokens,
                "hotloop.tokens.restored": u.restored_tokens,
                "hotloop.tokens.prefilled": u.prefilled_tokens,
                "hotloop.tokens.generated": u.completion_tokens,
                "hotloop.finish_reason": final.finish_reason or "",
                "hotloop.cache_hit": final.cache_hit,
            }
        )
        parent = trace.set_span_in_context(span)
        end = time.time_ns()
        total_ms = t.queue_ms + t.prefill_ms + t.decode_ms
        start = end - int(total_ms * 1e6)
        for name, ms in (("queue", t.queue_ms), ("prefill", t.prefill_ms), ("decode", t.decode_ms)):
            child = self.tracer.start_span(
                f"hotloop.{name}", context=parent, start_time=start, attributes=self._attrs
            )
            start += int(ms * 1e6)
            child.end(end_time=start)
        self.prefilled.add(u.prefilled_tokens, self._attrs)
        self.reused.add(u.cached_tokens + u.restored_tokens, self._attrs)
        if u.prompt_tokens:
            self.reuse_ratio.record((u.cached_tokens + u.restored_tokens) / u.prompt_tokens, self._attrs)
        self.affinity.add(1, {**self._attrs, "hotloop.cache_hit": final.cache_hit, "rpc.method": method})
        if u.completion_tokens:
            self.generated.add(u.completion_tokens, self._attrs)
            if u.completion_tokens > 1:
                self.itl.record(t.decode_ms * _MS / (u.completion_tokens - 1), self._attrs)
