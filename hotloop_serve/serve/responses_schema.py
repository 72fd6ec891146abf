"""OpenAI's Responses API: the request, its input items as a conversation, the response and its events.

Only what hotloop-serve honours is modelled (``docs/openai.md`` lists it); nothing here does
I/O. A request's ``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``) becomes engine messages appended to the conversation of
``previous_response_id``; the reply (text and calls, as ``openai_tools.ReplyCalls`` splits it)
becomes output items: a ``message`` with one ``output_text`` part, then one ``function_call``
per call. Streaming sends the spec's typed events (``response.created`` ... ``response.completed``),
built by :class:`EventWriter` from the same items as the stored response.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hotloop_serve import bounded_json
from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.tools import ToolCall, ToolChoice, ToolSpec
from hotloop_serve.errors import InvalidArgument, NotFound
from hotloop_serve.serve.openai_schema import ANY_JSON_OBJECT
from hotloop_serve.serve.openai_tools import tool_choice_of, tool_spec

ID_PREFIX = "resp_"
KEY_CHARS = 24
"""A response id is ``resp_`` + its conversation's routing key (24 characters, which the
affinity router hashes: every response of a conversation lives on one replica) + 22 random
characters (128 bits: ids are unguessable)."""
NODE_CHARS = 22


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Model):
    type: str
    text: str | None = None


class InputItem(_Model):
    """Any input item; which fields matter depends on ``type`` (checked by :func:`conversation_of`)."""

    type: str = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class FunctionTool(_Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Model):
    format: TextFormat | None = None


class ResponseRequest(_Model):
    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    text: TextOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    # llama.cpp server-style extensions, as on /v1/chat/completions (ignored, they would make a
    # greedy reply here differ from the same conversation's there)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    background: bool | None = None
    conversation: Any = None
    """Not modelled: refused (:func:`check_unmodelled`) rather than ignored, which would lose
    the state the client expects the server to keep."""


INCLUDE_NOTHING = frozenset(
    {
        "web_search_call.action.sources",
        "web_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
    }
)
"""``include`` values accepted and ignored: they add data to items this server never produces
(built-in tools' calls, images, reasoning), so including them changes nothing."""


def check_unmodelled(req: ResponseRequest) -> None:
    """Refuse, naming the field, what this server does not model and a client relies on:
    an ``include`` it cannot honour, ``conversation`` (the Conversations API), ``background: true``
    (a client polling for a queued response would otherwise get it finished, or wait on a
    stream it did not ask for)."""
    for i, value in enumerate(req.include or ()):
        if value == "message.output_text.logprobs":
            raise InvalidArgument(
                f"include.{i}: {value!r} is not supported here (chat completions have logprobs)", field=f"include.{i}"
            )
        if value not in INCLUDE_NOTHING:
            raise InvalidArgument(f"include.{i}: unknown value {value!r}", field=f"include.{i}")
    if req.background:
        raise InvalidArgument(
            "background: background responses are not supported; use stream: true to read a long one as it is made",
            field="background",
        )
    if req.conversation is not None:
        raise InvalidArgument(
            "conversation: the Conversations API is not supported; continue with previous_response_id",
            field="conversation",
        )


def parse_response_request(body: bytes) -> ResponseRequest:
    """The request, or InvalidArgument naming the first problem (JSON, a field, a value)."""
    data = bounded_json.loads(body, "the request body")  # depth-bounded, as chat completions'
    if not isinstance(data, dict):
        raise InvalidArgument("the request body must be a JSON object")
    try:
        req = ResponseRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArgument(f"{where}: {first['msg']}", field=where) from e
    check_unmodelled(req)
    return req


def key_of(response_id: str) -> str:
    """The routing key in a response id; NotFound for anything that is not one of ours."""
    if not response_id.startswith(ID_PREFIX) or len(response_id) != len(ID_PREFIX) + KEY_CHARS + NODE_CHARS:
        shown = response_id if len(response_id) <= 80 else response_id[:77] + "..."
        raise NotFound(f"response {shown!r} not found")
    return response_id[len(ID_PREFIX) : len(ID_PREFIX) + KEY_CHARS]


def new_response_id(key: str) -> str:
    assert len(key) == KEY_CHARS
    return ID_PREFIX + key + secrets.token_urlsafe(16)


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, p in enumerate(content):
        if p.type not in ("input_text", "output_text", "text") or p.text is None:
            raise InvalidArgument(
                f"{where}.{j}.type: only text content is supported (input_text, output_text), got {p.type!r}",
                field=f"{where}.{j}.type",
            )
        parts.append(p.text)
    return "".join(parts)


def conversation_of(
    req: ResponseRequest, history: tuple[ChatMessage, ...], max_messages: int
) -> tuple[list[ChatMessage], list[dict[str, Any]]]:
    """(the input as engine messages, the input items as stored, each with an id).

    A ``function_call`` joins the assistant message right before it (text then calls, as a
    reply is); a ``function_call_output`` must answer a call made before it, in this input or
    the conversation it continues."""
    items = [InputItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    if len(items) + len(history) > max_messages:
        raise InvalidArgument(
            f"input: the conversation would have {len(items) + len(history)} items; this server accepts at most "
            f"{max_messages}",
            field="input",
        )
    calls = {c.id: c.name for m in history for c in m.tool_calls}
    out: list[ChatMessage] = []
    stored: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if item.type == "message":
            if item.role is None:
                raise InvalidArgument(f"{where}.role: a message needs a role", field=f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            text = _text(item.content, f"{where}.content")
            out.append(ChatMessage(role, text))
            part = "output_text" if role == "assistant" else "input_text"
            stored.append(
                {
                    "type": "message",
                    "id": item.id or "msg_" + secrets.token_hex(16),
                    "role": item.role,
                    "status": "completed",
                    "content": [{"type": part, "text": text} | ({"annotations": []} if role == "assistant" else {})],
                }
            )
        elif item.type == "function_call":
            if not item.call_id or item.name is None or item.arguments is None:
                raise InvalidArgument(
                    f"{where}: a function_call needs call_id, name and arguments", field=f"{where}.call_id"
                )
            call = ToolCall(item.call_id, item.name, item.arguments)
            calls[call.id] = call.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatMessage("assistant", last.content, tool_calls=(*last.tool_calls, call))
            else:
                out.append(ChatMessage("assistant", "", tool_calls=(call,)))
            stored.append(function_call_item(call, item.id))
        elif item.type == "function_call_output":
            if not item.call_id or item.call_id not in calls:
                raise InvalidArgument(
                    f"{where}.call_id: {item.call_id!r} matches no function_call before it",
                    field=f"{where}.call_id",
                )
            text = item.output if isinstance(item.output, str) else _text(item.output, f"{where}.output")
            out.append(ChatMessage("tool", text, tool_call_id=item.call_id, name=calls[item.call_id]))
            stored.append(
                {
                    "type": "function_call_output",
                    "id": item.id or "fco_" + secrets.token_hex(16),
                    "call_id": item.call_id,
                    "output": text,
                    "status": "completed",
                }
            )
        elif item.type == "reasoning":
            continue  # this server produces none; a client replaying another model's may send them
        elif item.type == "item_reference":
            raise InvalidArgument(
                f"{where}.type: item_reference input items are not supported; send the item itself, "
                "or continue its response with previous_response_id",
                field=f"{where}.type",
            )
        else:
            raise InvalidArgument(
                f"{where}.type: {item.type!r} input items are not supported "
                "(message, function_call, function_call_output)",
                field=f"{where}.type",
            )
    if not out:
        raise InvalidArgument("input: no message or function call output to respond to", field="input")
    return out, stored


def tools_of(req: ResponseRequest) -> tuple[tuple[ToolSpec, ...], ToolChoice, bool]:
    tools = tuple(tool_spec(t.name, t.description, t.parameters, f"tools.{i}") for i, t in enumerate(req.tools or ()))
    choice = req.tool_choice
    named = choice.name if isinstance(choice, NamedFunction) else None
    mode = choice if isinstance(choice, str) else None
    return tools, tool_choice_of(tools, mode, named, "tool_choice"), req.parallel_tool_calls is not False


def settings_of(req: ResponseRequest, defaults: SamplingSettings) -> SamplingSettings:
    json_schema = None
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        json_schema = ANY_JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidArgument("text.format.schema is required with type json_schema", field="text.format.schema")
        json_schema = json.dumps(fmt.schema_)
    try:
        return defaults.merged(
            sample_len=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=None if req.seed is None else req.seed % 2**64,
            top_k=req.top_k,
            min_p=req.min_p,
            repeat_penalty=req.repeat_penalty,
            repeat_last_n=req.repeat_last_n,
            json_schema=json_schema,
            truncate_history=True if req.truncation == "auto" else None,
        )
    except InvalidArgument as e:
        message = e.message.replace("sample_len", "max_output_tokens")
        field = "max_output_tokens" if "sample_len" in e.message else None
        if json_schema is not None and e.message.startswith("json_schema"):
            message, field = "text.format." + message, "text.format.schema"
        raise InvalidArgument(message, field=field) from e


# ------------------------------------------------------------------------------- output


def function_call_item(call: ToolCall, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def output_of(message_id: str, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The output items of a reply: its text (when there is any or no call), then its calls."""
    out = [message_item(message_id, text)] if text or not calls else []
    return out + [function_call_item(c) for c in calls]


def response_json(
    response_id: str,
    echo: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, int] | None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The ``response`` object: what the request asked for (``echo``), status, output, usage."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at or int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        **echo,
        "output": output,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        },
    }


def echo_of(req: ResponseRequest, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> dict[str, Any]:
    """The request's fields a response repeats."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat()
    text_format: dict[str, Any] = {"type": fmt.type}
    if fmt.type == "json_schema":
        text_format.update(name=fmt.name or "response", schema=fmt.schema_, strict=fmt.strict)
    tool_choice: Any = choice.mode if choice.name is None else {"type": "function", "name": choice.name}
    return {
        "model": req.model,
        "instructions": req.instructions,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": tool_choice,
        "tools": [{"type": "function", **t.openai_json()["function"], "strict": False} for t in tools],
        "text": {"format": text_format},
        "truncation": req.truncation or "disabled",
        "reasoning": {"effort": None, "summary": None},
        "metadata": req.metadata or {},
        "user": req.user,
    }


# ------------------------------------------------------------------------------- streaming


class EventWriter:
    """The spec's typed events for one response, from the owner's items (text and call pieces).

    Each event is ``(type, data)`` with a ``sequence_number``; the text message item (when the
    reply has text) comes first, then each call's item, as in the stored output."""

    def __init__(self, response: dict[str, Any], message_id: str) -> None:
        self._response = response
        self._message_id = message_id
        self._seq = 0
        self._text: list[str] | None = None
        self._calls: list[dict[str, Any]] = []
        self._index = 0

    def _event(self, kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return kind, event

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            self._event("response.created", response=self._response),
            self._event("response.in_progress", response=self._response),
        ]

    def _open_text(self) -> list[tuple[str, dict[str, Any]]]:
        self._text = []
        part = {"type": "output_text", "text": "", "annotations": []}
        item = message_item(self._message_id, "", "in_progress")
        item["content"] = []
        return [
            self._event("response.output_item.added", output_index=self._index, item=item),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=self._index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_text(self) -> list[tuple[str, dict[str, Any]]]:
        if self._text is None:
            return []
        text = "".join(self._text)
        self._text = None
        ids = {"item_id": self._message_id, "output_index": self._index, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": []}
        events = [
            self._event("response.output_text.done", **ids, text=text, logprobs=[]),
            self._event("response.content_part.done", **ids, part=part),
            self._event(
                "response.output_item.done", output_index=self._index, item=message_item(self._message_id, text)
            ),
        ]
        self._index += 1
        return events

    def _close_call(self) -> list[tuple[str, dict[str, Any]]]:
        if not self._calls or self._calls[-1]["status"] == "completed":
            return []
        item = self._calls[-1]
        item["status"] = "completed"
        events = [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=self._index,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self._event("response.output_item.done", output_index=self._index, item=dict(item)),
        ]
        self._index += 1
        return events

    def item(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if item["text"]:
            if self._text is None:
                events += self._open_text()
            assert self._text is not None
            self._text.append(item["text"])
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._message_id,
                    output_index=self._index,
                    content_index=0,
                    delta=item["text"],
                    logprobs=[],
                )
            )
        for piece in item.get("tool_calls", ()):
            if "id" in piece:
                events += self._close_text() + self._close_call()
                call = function_call_item(ToolCall(piece["id"], piece["name"], ""))
                call["status"] = "in_progress"
                self._calls.append(call)
                events.append(self._event("response.output_item.added", output_index=self._index, item=dict(call)))
            if piece["arguments"]:
                self._calls[-1]["arguments"] += piece["arguments"]
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._calls[-1]["id"],
                        output_index=self._index,
                        delta=piece["arguments"],
                    )
                )
        return events

    def finish(self, response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Close the open items; then ``response.completed`` (or ``.incomplete``)."""
        events = []
        if self._index == 0 and self._text is None and not self._calls:  # an empty reply: its empty message
            events += self._open_text()
        events += self._close_text() + self._close_call()
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def error(self, code: str, message: str, param: str | None) -> tuple[str, dict[str, Any]]:
        return self._event("error", code=code, message=message, param=param)


# ------------------------------------------------------------------------------- the call


@dataclass(frozen=True, slots=True)
class RespondCall:
    """What the receiving replica hands the conversation's owner (routed by ``key``): the
    request as parsed (its input is checked there, against the conversation it continues)."""

    key: str
    response_id: str
    principal: str
    request: ResponseRequest
    settings: SamplingSettings
    tools: tuple[ToolSpec, ...]
    tool_choice: ToolChoice | None
    """When the reply may hold calls: parse them."""
    echo: dict[str, Any]
    traceparent: str | None = None
