"""The attribute and metric names hotloop-serve emits, in one place.

OpenTelemetry's GenAI semantic conventions (status: development; names checked against
semantic-conventions-genai's gen-ai-spans.md / gen-ai-metrics.md and the
``opentelemetry-semantic-conventions`` package pinned through the SDK) where they cover what we
emit; ``hotloop.*`` only for what they do not (KV-cache reuse by origin, replica, cache hit,
sessions, queue). The mapping table is in docs/observability.md.
"""

from __future__ import annotations

# -- GenAI attributes ------------------------------------------------------------------------
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_STREAM = "gen_ai.request.stream"
CONVERSATION_ID = "gen_ai.conversation.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
ERROR_TYPE = "error.type"

# -- GenAI model-server metrics --------------------------------------------------------------
SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"

# Bucket boundaries the conventions ask for (seconds).
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# -- values ----------------------------------------------------------------------------------
PROVIDER = "hotloop"
"""No well-known provider value fits a self-hosted llama.cpp server; the conventions allow a custom
one, and it tells a backend that ``hotloop.*`` attributes come with these spans."""

OPERATIONS = {"Generate": "chat", "Warmup": "warmup", "ChatCompletions": "chat"}
"""gRPC method -> gen_ai.operation.name. Generate is a chat completion; Warmup (prefill a prompt
into a session's cache, no output) has no well-known value, so it gets a custom one.
ChatCompletions is the OpenAI-compatible HTTP API's turn (``serve/openai_http.py``)."""

FINISH_REASON_MAP = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
"""Engine finish reason -> the usual GenAI value (``hotloop.finish_reason`` keeps the engine's)."""

# -- hotloop attributes ----------------------------------------------------------------------
REPLICA = "hotloop.replica"
SESSION_ID_LEGACY = "hotloop.session_id"
CACHE_HIT = "hotloop.cache_hit"
FINISH_REASON = "hotloop.finish_reason"
TOKENS_REUSED = "hotloop.tokens.reused"
TOKENS_RESTORED = "hotloop.tokens.restored"
TOKENS_PREFILLED = "hotloop.tokens.prefilled"
TIME_TO_FIRST_TOKEN_MS = "hotloop.time_to_first_token_ms"

# -- hotloop metrics (Prometheus names: dots -> underscores, counters + _total, unit suffixes) --
TOKENS_GENERATED_METRIC = "hotloop.tokens.generated"
TOKENS_PREFILLED_METRIC = "hotloop.tokens.prefilled"
TOKENS_REUSED_METRIC = "hotloop.tokens.reused"
REUSE_RATIO_METRIC = "hotloop.cache.reuse_ratio"
AFFINITY_METRIC = "hotloop.affinity.requests"
RPC_ERRORS_METRIC = "hotloop.rpc.errors"
GAUGES = (
    # (metric, EngineStats field, unit)
    ("hotloop.sessions.active", "active_requests", "{session}"),
    ("hotloop.sessions.hot", "hot_sessions", "{session}"),
    ("hotloop.sessions.evicted", "evicted_sessions", "{session}"),
    ("hotloop.sessions.total", "sessions", "{session}"),
    ("hotloop.kv.evicted_bytes", "evicted_bytes", "By"),
    ("hotloop.kv.tokens", "kv_tokens", "{token}"),
    ("hotloop.queue.depth", "waiting_requests", "{request}"),
)
