"""The spans, instruments and request log of one replica.

One SERVER span per RPC (continued from the caller's W3C ``traceparent``). A Generate or Warmup
that completes gets, after the fact and from the request's timings, an INTERNAL GenAI span
(``chat <model>``, OpenTelemetry GenAI conventions) with children for queueing, prefill and
decode: nothing runs per token. Metrics go through the OpenTelemetry API, so with no provider
installed (the default) every call is a no-op. Each RPC ends with one request-log line
(``request_log.py``). Names: ``semconv.py``; mapping table: docs/observability.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util import types

from hotloop_serve.engine.stream import Chunk
from hotloop_serve.errors import HotloopError
from hotloop_serve.telemetry import semconv as sc
from hotloop_serve.telemetry.request_log import Format, RequestLog, configure_request_log

_SERVICES = {
    "ListModels": "hotloop.v1.ModelService",
    "GetModel": "hotloop.v1.ModelService",
    "Tokenize": "hotloop.v1.ModelService",
}
_MS = 1e-3


class RpcSpan(Span):
    """The SERVER span of one RPC, as the servicer sees it: a Span that also keeps what the
    request log needs (session, final usage, time to first token).

    ``hotloop.session_id`` set by the servicer is recorded as ``gen_ai.conversation.id``.
    """

    def __init__(self, span: Span, method: str) -> None:
        self.span = span
        self.method = method
        self.started = time.perf_counter()
        self.session_id: str | None = None
        self.final: Chunk | None = None
        self.ttft_s: float | None = None

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if key in (sc.SESSION_ID_LEGACY, sc.CONVERSATION_ID):
            key = sc.CONVERSATION_ID
            self.session_id = str(value)
        self.span.set_attribute(key, value)

    def set_attributes(self, attributes: dict[str, types.AttributeValue]) -> None:  # type: ignore[override]
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def end(self, end_time: int | None = None) -> None:
        self.span.end(end_time)

    def get_span_context(self) -> SpanContext:
        return self.span.get_span_context()

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        self.span.add_event(name, attributes, timestamp)

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        self.span.add_link(context, attributes)

    def update_name(self, name: str) -> None:
        self.span.update_name(name)

    def is_recording(self) -> bool:
        return self.span.is_recording()

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self.span.set_status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.span.record_exception(exception, attributes, timestamp, escaped)


class Telemetry:
    """Tracer + meter + request log for one model replica; ``stats`` feeds the engine gauges."""

    def __init__(
        self,
        model: str,
        replica: str,
        stats: Callable[[], Any] | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        request_log: Format = "off",
    ) -> None:
        self.model = model
        self.replica = replica
        self.tracer = trace.get_tracer("hotloop_serve", tracer_provider=tracer_provider)
        meter = metrics.get_meter("hotloop_serve", meter_provider=meter_provider)
        self._attrs: dict[str, types.AttributeValue] = {sc.REQUEST_MODEL: model, sc.REPLICA: replica}
        self._genai = {
            method: {**self._attrs, sc.OPERATION_NAME: op, sc.PROVIDER_NAME: sc.PROVIDER}
            for method, op in sc.OPERATIONS.items()
        }
        self.request_duration = meter.create_histogram(
            sc.SERVER_REQUEST_DURATION,
            unit="s",
            description="GenAI server request duration (Generate, Warmup), errors included with error.type",
            explicit_bucket_boundaries_advisory=sc.REQUEST_DURATION_BUCKETS,
        )
        self.ttft = meter.create_histogram(
            sc.SERVER_TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Request arrival to the first streamed chunk",
            explicit_bucket_boundaries_advisory=sc.TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            sc.SERVER_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Decode time per output token after the first, per request",
            explicit_bucket_boundaries_advisory=sc.TIME_PER_OUTPUT_TOKEN_BUCKETS,
        )
        self.generated = meter.create_counter(sc.TOKENS_GENERATED_METRIC, unit="{token}")
        self.prefilled = meter.create_counter(sc.TOKENS_PREFILLED_METRIC, unit="{token}")
        self.reused = meter.create_counter(sc.TOKENS_REUSED_METRIC, unit="{token}")
        self.reuse_ratio = meter.create_histogram(sc.REUSE_RATIO_METRIC, unit="1")
        self.affinity = meter.create_counter(sc.AFFINITY_METRIC, unit="{request}")
        self.errors = meter.create_counter(sc.RPC_ERRORS_METRIC, unit="{request}")
        self._stats = stats
        if stats is not None:
            for name, field, unit in sc.GAUGES:
                meter.create_observable_gauge(name, callbacks=[self._gauge(field)], unit=unit)
        if request_log != "off":
            configure_request_log(request_log)
        self.log = RequestLog(request_log)

    def _gauge(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            assert self._stats is not None
            yield Observation(getattr(self._stats(), field), self._attrs)

        return observe

    @contextmanager
    def rpc(self, method: str, grpc_context: Any) -> Iterator[RpcSpan]:
        """A SERVER span for one RPC, child of the caller's trace context when it sent one;
        on exit: the GenAI request duration (Generate, Warmup) and the request-log line."""
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
        call = RpcSpan(span, method)
        code = "OK"
        try:
            yield call
        except HotloopError as e:
            code = e.code
            self._error(span, method, e.code, e.message)
            raise
        except BaseException as e:
            cancelled = isinstance(e, GeneratorExit) or type(e).__name__ == "CancelledError"
            code = "CANCELLED" if cancelled else "INTERNAL"
            self._error(span, method, code, str(e) or type(e).__name__)
            raise
        else:
            span.set_attribute("rpc.grpc.status_code", "OK")
        finally:
            span.end()
            elapsed = time.perf_counter() - call.started
            genai = self._genai.get(method)
            if genai is not None:
                self.request_duration.record(elapsed, genai if code == "OK" else {**genai, sc.ERROR_TYPE: code})
            if self.log.enabled:
                self.log.write(self._log_fields(call, service, code, elapsed, parent))

    def _error(self, span: Span, method: str, code: str, message: str) -> None:
        span.set_attribute("rpc.grpc.status_code", code)
        span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
        self.errors.add(1, {**self._attrs, "rpc.method": method, "rpc.grpc.status_code": code})

    def first_token(self, span: RpcSpan, seconds: float) -> None:
        span.ttft_s = seconds
        span.set_attribute(sc.TIME_TO_FIRST_TOKEN_MS, seconds * 1e3)
        self.ttft.record(seconds, self._genai.get(span.method, self._genai["Generate"]))

    def record_usage(self, span: RpcSpan, final: Chunk, method: str) -> None:
        """The GenAI span (with queue, prefill, decode children) and metrics from a request's final chunk."""
        u, t = final.usage, final.timings
        if u is None or t is None:
            return
        span.final = final
        genai = self._genai.get(method, self._genai["Generate"])
        cache_read = u.cached_tokens + u.restored_tokens
        attributes: dict[str, types.AttributeValue] = {
            **genai,
            sc.RESPONSE_MODEL: self.model,
            sc.INPUT_TOKENS: u.prompt_tokens,
            sc.OUTPUT_TOKENS: u.completion_tokens,
            sc.CACHE_READ_INPUT_TOKENS: cache_read,
            sc.TOKENS_REUSED: u.cached_tokens,
            sc.TOKENS_RESTORED: u.restored_tokens,
            sc.TOKENS_PREFILLED: u.prefilled_tokens,
            sc.FINISH_REASON: final.finish_reason or "",
            sc.CACHE_HIT: final.cache_hit,
        }
        if method == "Generate":  # Warmup generates nothing: no finish reasons
            attributes[sc.REQUEST_STREAM] = True
            attributes[sc.FINISH_REASONS] = _finish_reasons(final.finish_reason)
        if span.session_id is not None:
            attributes[sc.CONVERSATION_ID] = span.session_id
        end = time.time_ns()
        total_ms = t.queue_ms + t.prefill_ms + t.decode_ms
        start = end - int(total_ms * 1e6)
        op = genai[sc.OPERATION_NAME]
        genai_span = self.tracer.start_span(
            f"{op} {self.model}",
            context=trace.set_span_in_context(span.span),
            kind=SpanKind.INTERNAL,
            start_time=start,
            attributes=attributes,
        )
        parent = trace.set_span_in_context(genai_span)
        for name, ms in (("queue", t.queue_ms), ("prefill", t.prefill_ms), ("decode", t.decode_ms)):
            child = self.tracer.start_span(f"hotloop.{name}", context=parent, start_time=start, attributes=self._attrs)
            start += int(ms * 1e6)
            child.end(end_time=start)
        genai_span.end(end_time=end)

        self.prefilled.add(u.prefilled_tokens, self._attrs)
        self.reused.add(cache_read, self._attrs)
        if u.prompt_tokens:
            self.reuse_ratio.record(cache_read / u.prompt_tokens, self._attrs)
        self.affinity.add(1, {**self._attrs, sc.CACHE_HIT: final.cache_hit, "rpc.method": method})
        if u.completion_tokens:
            self.generated.add(u.completion_tokens, self._attrs)
            if u.completion_tokens > 1:
                self.tpot.record(t.decode_ms * _MS / (u.completion_tokens - 1), genai)

    def _log_fields(self, call: RpcSpan, service: str, code: str, elapsed: float, parent: Any) -> dict[str, Any]:
        ctx = call.get_span_context()
        if not ctx.is_valid and parent is not None:
            ctx = trace.get_current_span(parent).get_span_context()
        fields: dict[str, Any] = {
            "rpc.service": service,
            "rpc.method": call.method,
            "rpc.grpc.status_code": code,
            "duration_ms": round(elapsed * 1e3, 3),
            "trace_id": format(ctx.trace_id, "032x") if ctx.is_valid else None,
            "span_id": format(call.get_span_context().span_id, "016x") if call.get_span_context().is_valid else None,
            sc.REQUEST_MODEL: self.model,
            sc.REPLICA: self.replica,
            sc.CONVERSATION_ID: call.session_id,
        }
        if call.method in self._genai:
            fields[sc.OPERATION_NAME] = self._genai[call.method][sc.OPERATION_NAME]
        if call.ttft_s is not None:
            fields[sc.TIME_TO_FIRST_TOKEN_MS] = round(call.ttft_s * 1e3, 3)
        final = call.final
        if final is not None and final.usage is not None:
            u = final.usage
            fields.update(
                {
                    sc.INPUT_TOKENS: u.prompt_tokens,
                    sc.OUTPUT_TOKENS: u.completion_tokens,
                    sc.CACHE_READ_INPUT_TOKENS: u.cached_tokens + u.restored_tokens,
                    sc.TOKENS_PREFILLED: u.prefilled_tokens,
                    sc.CACHE_HIT: final.cache_hit,
                }
            )
            if call.method == "Generate":
                fields[sc.FINISH_REASONS] = _finish_reasons(final.finish_reason)
                fields[sc.FINISH_REASON] = final.finish_reason
        return fields


def _finish_reasons(reason: str | None) -> Sequence[str]:
    if not reason:
        return []
    return [sc.FINISH_REASON_MAP.get(reason, reason)]
