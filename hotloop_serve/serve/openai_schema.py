"""OpenAI's chat-completions request and response shapes, and their mapping onto the engine.

Only what hotloop-serve honours is modelled; other fields a client sends are ignored, except
those whose silent dropping would change the reply (non-zero presence or frequency penalties,
``n`` beyond :data:`MAX_CHOICES`), which are refused with a 400 naming them. Tools:
``openai_tools.py``; ``n`` > 1: ``openai_choices.py``. Nothing here does I/O: ``openai_http.py``
is the HTTP layer.

Mapping (OpenAI -> ``SamplingSettings``): ``max_completion_tokens`` / ``max_tokens`` ->
``sample_len``; ``temperature``, ``top_p``, ``seed``, ``stop`` as they are; ``response_format``
``json_object`` -> ``json_schema='{"type": "object"}'``, ``json_schema`` -> its ``schema``;
``logprobs`` / ``top_logprobs`` as they are. Extensions, as llama.cpp's server names them:
``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``grammar`` (GBNF).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hotloop_serve import bounded_json
from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import Chunk, TokenLogprob
from hotloop_serve.engine.tools import ToolCall, ToolChoice, ToolSpec
from hotloop_serve.errors import HotloopError, InvalidArgument

MAX_CHOICES = 8
"""The most choices (``n``) one request may ask for: each runs as its own engine request, in
its own session forked from the prompt's, so ``n`` is bounded like a client's concurrency."""

SESSION_HEADER = "x-session-id"
"""Request header naming a conversation explicitly (any string up to :data:`MAX_SESSION_HEADER`
characters); without it a conversation is known by its opening messages."""
MAX_SESSION_HEADER = 256
ANY_JSON_OBJECT = '{"type": "object"}'
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

# ------------------------------------------------------------------------------- request


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Model):
    name: str
    arguments: str


class ToolCallIn(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(_Model):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # llama.cpp server-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    grammar: str | None = None


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The request, or InvalidArgument naming the first problem (JSON, a field, a value)."""
    data = bounded_json.loads(body, "the request body")
    if not isinstance(data, dict):
        raise InvalidArgument("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"{where}: {first['msg']}", field=where) from e


def messages_of(req: ChatCompletionRequest, max_messages: int) -> list[ChatMessage]:
    """The history as the engine sees it; a ``tool`` message must answer a call made before it."""
    if len(req.messages) > max_messages:
        raise InvalidArgument(
            f"messages has {len(req.messages)} entries; this server accepts at most {max_messages}", field="messages"
        )
    out: list[ChatMessage] = []
    calls: dict[str, str] = {}  # id -> function name, of the calls made so far
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidArgument(
                    f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                    field=f"messages.{i}.tool_call_id",
                )
            if m.tool_call_id not in calls:
                raise InvalidArgument(
                    f"messages.{i}.tool_call_id: {m.tool_call_id!r} matches no tool call of an earlier message",
                    field=f"messages.{i}.tool_call_id",
                )
            out.append(ChatMessage("tool", m.text(), tool_call_id=m.tool_call_id, name=calls[m.tool_call_id]))
            continue
        tool_calls: tuple[ToolCall, ...] = ()
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidArgument(
                    f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                    field=f"messages.{i}.tool_calls",
                )
            tool_calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls)
            calls.update((c.id, c.name) for c in tool_calls)
        out.append(ChatMessage("system" if m.role == "developer" else m.role, m.text(), tool_calls=tool_calls))
    return out


def settings_of(req: ChatCompletionRequest, defaults: SamplingSettings) -> SamplingSettings:
    """The request's sampling settings layered over the model's defaults; refuses what it cannot honour."""
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise InvalidArgument(f"n: must be between 1 and {MAX_CHOICES}, got {req.n}", field="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise InvalidArgument(f"{name}: not supported; use repeat_penalty (and repeat_last_n)", field=name)
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgument("top_logprobs: requires logprobs: true", field="top_logprobs")
    json_schema = None
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        json_schema = ANY_JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidArgument(
                "response_format.json_schema.schema is required with type json_schema",
                field="response_format.json_schema.schema",
            )
        json_schema = json.dumps(fmt.json_schema.schema_)
    if json_schema is not None and req.grammar:
        raise InvalidArgument("grammar and response_format are exclusive: send one of them", field="grammar")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    seed = None if req.seed is None else req.seed % 2**64
    try:
        return defaults.merged(
            sample_len=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=seed,
            stop=stop,
            top_k=req.top_k,
            min_p=req.min_p,
            repeat_penalty=req.repeat_penalty,
            repeat_last_n=req.repeat_last_n,
            grammar=req.grammar or None,
            json_schema=json_schema,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
        )
    except InvalidArgument as e:
        message = e.message.replace("sample_len", "max_completion_tokens")
        if json_schema is not None and e.message.startswith("json_schema"):
            message = "response_format." + message
        raise InvalidArgument(message) from e


# ------------------------------------------------------------------------------- routing


def conversation_key(principal: str, model: str, messages: list[ChatMessage], session: str | None) -> str:
    """The routing key of a conversation: from the caller's session header when it sent one,
    else from its opening (every message up to and including the first user message), which
    every later request of the conversation repeats. The principal is part of the hash, so two
    principals never share a key (nor a session: ids are signed per principal anyway)."""
    if session is not None and len(session) > MAX_SESSION_HEADER:
        raise InvalidArgument(
            f"the {SESSION_HEADER} header is {len(session)} characters; at most {MAX_SESSION_HEADER}",
            field=SESSION_HEADER,
        )
    if session:
        source = "s\0" + session
    else:
        opening: list[tuple[str, str]] = []
        for m in messages:
            opening.append((m.role, m.content))
            if m.role == "user":
                break
        source = "o\0" + json.dumps(opening)
    digest = hashlib.blake2b(f"{principal}\0{model}\0{source}".encode(), digest_size=16).digest()
    return "oa" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


# ------------------------------------------------------------------------------- the call


@dataclass(frozen=True, slots=True)
class ChatCall:
    """What the receiving replica hands the conversation's owner (through a deployment handle:
    the affinity router reads ``session_key``)."""

    session_key: str
    principal: str
    messages: list[ChatMessage]
    settings: SamplingSettings
    traceparent: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    """Rendered into the prompt by the model's template (whatever ``tool_choice`` says)."""
    tool_choice: ToolChoice | None = None
    """When the reply may hold calls (the settings' grammar constrains them): parse them."""
    n: int = 1
    """Choices to generate from the prompt (``openai_choices.py``); their items carry ``index``."""


# ------------------------------------------------------------------------------- response


def logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.piece.decode("utf-8", errors="replace"),
        "logprob": lp.logprob,
        "bytes": list(lp.piece),
        "top_logprobs": [
            {"token": p.decode("utf-8", errors="replace"), "logprob": v, "bytes": list(p)} for _, p, v in lp.top
        ],
    }


def hotloop_json(final: Chunk, served_by: Any) -> dict[str, Any]:
    """The ``hotloop`` extension of a reply's last object: where its prompt came from (cached,
    restored from RAM, prefilled), server timings, and which replica served it."""
    u, t = final.usage, final.timings
    assert u is not None and t is not None
    return {
        "usage": {
            "cached_tokens": u.cached_tokens,
            "restored_tokens": u.restored_tokens,
            "prefilled_tokens": u.prefilled_tokens,
        },
        "timings": {
            "queue_ms": t.queue_ms,
            "prefill_ms": t.prefill_ms,
            "time_to_first_token_ms": t.time_to_first_token_ms,
            "decode_ms": t.decode_ms,
        },
        "served_by": {
            "replica": served_by.replica,
            "replica_rank": served_by.replica_rank,
            "cache_hit": final.cache_hit,
        },
    }


def usage_json(usage: dict[str, int]) -> dict[str, Any]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def choice_json(
    index: int, message: dict[str, Any], finish: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One choice of a ``chat.completion``: ``message`` is the assistant's (content, tool calls)."""
    return {
        "index": index,
        "message": {"role": "assistant", "refusal": None, **message},
        "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
        "finish_reason": finish,
    }


def completion_json(cid: str, model: str, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage_json(usage),
    }


def chunk_json(
    cid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                "finish_reason": finish,
            }
        ],
    }


# ------------------------------------------------------------------------------- errors

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {
    "UNAUTHENTICATED": "invalid_api_key",
    "OUT_OF_RANGE": "context_length_exceeded",
    "RESOURCE_EXHAUSTED": "rate_limit_exceeded",
}


class RequestTooLarge(HotloopError):
    """A body over ``limits.max_request_bytes``: HTTP 413 (gRPC says RESOURCE_EXHAUSTED)."""

    code = "RESOURCE_EXHAUSTED"


def error_json(
    code: str, message: str, param: str | None = None, status: int | None = None
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI-style error body) for an error with gRPC status name ``code``."""
    status = status or HTTP_STATUS.get(code, 500)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    err_code = "model_not_found" if code == "NOT_FOUND" and "model" in message else _CODES.get(code)
    if status == 413:
        err_code = "request_too_large"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": err_code}}


def error_of(e: HotloopError) -> tuple[int, dict[str, Any]]:
    return error_json(e.code, e.message, getattr(e, "field", None), 413 if isinstance(e, RequestTooLarge) else None)
