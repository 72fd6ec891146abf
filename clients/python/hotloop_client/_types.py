"""The SDK's value types: plain frozen dataclasses, so callers never handle protobuf messages.

They mirror the messages of ``protos/hotloop/v1`` field by field; the conversions live in
``_base.py`` (one function per direction), so adding a proto field means touching one
dataclass here and one pair of functions there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any


class Role(enum.Enum):
    """Who wrote a message. The values are the role names chat templates use."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result; ``Message.tool_call_id`` names the call it answers


class FinishReason(enum.Enum):
    """Why a reply ended (only on the last chunk of a turn)."""

    EOS = "eos"  # the model ended its turn
    LENGTH = "length"  # sample_len reached
    STOP = "stop"  # a stop sequence matched; it is not part of the text
    CONTEXT = "context"  # the session's context window is full
    TOOL_CALLS = "tool_calls"  # the reply ended with complete tool calls


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made; ``arguments`` is JSON text matching the tool's parameters."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. ``parameters`` is the arguments' JSON Schema (type
    object), as a dict or JSON text; the server builds a grammar from it, so calls validate."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call ``index`` of a streamed reply: ``id`` and ``name`` come with its first
    piece only (empty on the others); the ``arguments`` pieces, joined, are the call's."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the conversation. The caller owns the history and sends all of it
    every turn: the server's session is only a cache of it (hot-loop's model)."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's calls (``content``: the text before them, often empty)."""
    tool_call_id: str = ""
    """A ``Role.TOOL`` message: the id of the call it is the result of."""

    def __post_init__(self) -> None:
        # Accept "user" as well as Role.USER: histories often come from JSON.
        if not isinstance(self.role, Role):
            object.__setattr__(self, "role", Role(str(self.role).lower()))


@dataclass(frozen=True, slots=True)
class Settings:
    """Sampling settings of a session; ``None`` means "not set" (the server's default, or
    in a per-turn override, the session's value). Mirrors ``hotloop.v1.Settings``.

    The server validates the values (INVALID_ARGUMENT names the bad field), so the SDK does
    not duplicate its bounds here and cannot drift from them.
    """

    temperature: float | None = None
    """>= 0; 0 means greedy decoding."""
    sample_len: int | None = None
    """Maximum tokens generated per turn."""
    seed: int | None = None
    """Fixed seed (reproducible replies); None draws a fresh seed every turn."""
    top_p: float | None = None
    """Nucleus sampling, in (0, 1]."""
    top_k: int | None = None
    """0 disables top-k."""
    repeat_penalty: float | None = None
    """> 0; 1.0 disables it."""
    repeat_last_n: int | None = None
    """Tokens the repeat penalty looks back over."""
    stop: tuple[str, ...] | None = None
    """Generation ends before any of these strings (at most 8)."""
    min_p: float | None = None
    """In [0, 1)."""
    truncate_history: bool | None = None
    """Drop the oldest turns (system prompt kept) instead of failing with OUT_OF_RANGE."""
    grammar: str | None = None
    """Structured output: a GBNF grammar (llama.cpp's syntax, start symbol ``root``) every reply matches."""
    json_schema: str | None = None
    """Structured output: a JSON Schema (JSON text) every reply matches; ``'{"type": "object"}'``: any object."""
    logprobs: bool | None = None
    """Report each generated token's log-probability (``Chunk.logprobs``)."""
    top_logprobs: int | None = None
    """With ``logprobs``: also the most likely alternatives at each position, 0-20."""

    def __post_init__(self) -> None:
        # A frozen dataclass must stay hashable: store stop sequences as a tuple even when
        # the caller passes a list or a single string.
        stop: Any = self.stop
        if isinstance(stop, str):
            object.__setattr__(self, "stop", (stop,))
        elif stop is not None and not isinstance(stop, tuple):
            object.__setattr__(self, "stop", tuple(stop))

    def merged(self, overrides: Settings) -> Settings:
        """These settings with every field that ``overrides`` sets replacing ours."""
        changes = {f.name: getattr(overrides, f.name) for f in fields(self)}
        return Settings(**{k: (v if v is not None else getattr(self, k)) for k, v in changes.items()})

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, in declaration order (for display and logging)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True, slots=True)
class Usage:
    """Where a request's prompt tokens came from and how many it generated."""

    prompt_tokens: int = 0
    """Tokens of the rendered history."""
    cached_tokens: int = 0
    """Reused from the session's hot KV cache (or a shared prefix)."""
    restored_tokens: int = 0
    """Restored from host RAM after an eviction."""
    prefilled_tokens: int = 0
    """Computed for this request."""
    completion_tokens: int = 0
    """Generated."""


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side timings of one request, in milliseconds."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    decode_ms: float = 0.0
    """From the first to the last generated token."""


@dataclass(frozen=True, slots=True)
class ServedBy:
    """Which replica served a request and whether the session's cache was there."""

    replica: str = ""
    replica_rank: int = 0
    cache_hit: bool = False


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its id, bytes and natural-log probability under the model's raw
    distribution; ``top``: the most likely alternatives at its position (``top_logprobs``), best first."""

    token: int
    piece: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()

    @property
    def text(self) -> str:
        return self.piece.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a streamed reply. Only the last chunk of a turn carries ``finish_reason``,
    ``usage``, ``timings`` and ``served_by``; on the others they are ``None``."""

    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    served_by: ServedBy | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``Settings(logprobs=True)``: the tokens generated since the previous chunk."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    """With ``tools``: pieces of the reply's calls (``text`` never holds call syntax)."""

    @property
    def is_last(self) -> bool:
        """True on the chunk that ends the turn."""
        return self.finish_reason is not None or self.usage is not None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server knows of one served model (``ModelService.GetModel``)."""

    name: str
    architecture: str = ""
    context_length: int = 0
    """Tokens one session may hold."""
    train_context_length: int = 0
    quantization: str = ""
    has_chat_template: bool = False
    chat_template_source: str = ""
    parameters: int = 0
    size_bytes: int = 0
    vocab_size: int = 0
    replicas: int = 0


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """The server's view of a session (``SessionService.GetSession``)."""

    id: str
    model: str
    settings: Settings = field(default_factory=Settings)
    """The session's settings with every field the server fills in."""
    context_tokens: int = 0
    """Tokens held in the session's KV cache (hot or evicted)."""
    state: str = ""
    """"new", "hot", "evicted" or "dropped"."""
    served_by: ServedBy | None = None
    last_used: float = 0.0
    """When the session last served a request (Unix seconds; 0 if never)."""
