"""The one conversion between the API's protos and the engine's types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hotloop.v1 import common_pb2 as pb
from hotloop.v1 import session_pb2 as spb

from hotloop_serve import bounded_json
from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.grammar import MAX_SCHEMA_DEPTH
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import Chunk, Timings, TokenLogprob, Usage
from hotloop_serve.engine.tools import ToolCall, ToolChoice, ToolSpec
from hotloop_serve.errors import InvalidArgument
from hotloop_serve.serve.openai_tools import tool_choice_of, tool_spec

_ROLES = {pb.ROLE_SYSTEM: "system", pb.ROLE_USER: "user", pb.ROLE_ASSISTANT: "assistant", pb.ROLE_TOOL: "tool"}
FINISH_TOOL_CALLS = pb.FINISH_REASON_TOOL_CALLS
_FINISH = {
    "eos": pb.FINISH_REASON_EOS,
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
}
# The ``optional`` scalar fields of ``hotloop.v1.Settings`` (presence = set), from its
# descriptor: a field added to the proto needs no list edited here (``stop`` is repeated).
_SETTING_FIELDS = tuple(f.name for f in pb.Settings.DESCRIPTOR.fields if f.has_presence)


def messages_from_proto(messages: Sequence[pb.Message], max_messages: int) -> list[ChatMessage]:
    """Validate and convert a history; the error names the offending message."""
    if not messages:
        raise InvalidArgument("history is empty: send at least one message", reason="EMPTY_HISTORY", field="messages")
    if len(messages) > max_messages:
        raise InvalidArgument(
            f"history has {len(messages)} messages; this server accepts at most {max_messages}",
            reason="TOO_MANY_MESSAGES",
            field="messages",
        )
    out = []
    calls: dict[str, str] = {}  # id -> name of the calls made so far
    for i, m in enumerate(messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise InvalidArgument(
                f"message {i}: unknown role {m.role}; use ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL",
                reason="UNKNOWN_ROLE",
                field=f"messages[{i}].role",
            )
        if m.tool_calls and role != "assistant":
            raise InvalidArgument(
                f"message {i}: only assistant messages carry tool calls", field=f"messages[{i}].tool_calls"
            )
        if role == "tool":
            if m.tool_call_id not in calls:
                raise InvalidArgument(
                    f"message {i}: tool_call_id {m.tool_call_id[:80]!r} matches no tool call of an earlier message",
                    field=f"messages[{i}].tool_call_id",
                )
            out.append(ChatMessage(role, m.content, tool_call_id=m.tool_call_id, name=calls[m.tool_call_id]))
            continue
        tool_calls = tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls)
        calls.update((c.id, c.name) for c in tool_calls)
        out.append(ChatMessage(role, m.content, tool_calls=tool_calls))
    return out


def tools_from_proto(request: spb.GenerateRequest) -> tuple[tuple[ToolSpec, ...], ToolChoice, bool]:
    """A Generate's (tools, tool choice, parallel calls allowed), checked as the HTTP API's are."""
    tools = []
    for i, t in enumerate(request.tools):
        where = f"tools[{i}].parameters"
        parameters = bounded_json.loads(t.parameters, where, MAX_SCHEMA_DEPTH, where) if t.parameters else None
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"tools[{i}].parameters must be a JSON object", field=f"tools[{i}].parameters")
        tools.append(tool_spec(t.name, t.description, parameters, f"tools[{i}]"))
    mode = request.tool_choice if request.tool_choice in ("auto", "none", "required") else None
    named = request.tool_choice if request.tool_choice and mode is None else None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return tuple(tools), tool_choice_of(tools, mode, named, "tool_choice"), parallel


def tool_calls_to_proto(pieces: Sequence[dict[str, Any]]) -> list[pb.ToolCallDelta]:
    """The call pieces of a reply item (``openai_tools.ReplyCalls``) as ``ToolCallDelta``s."""
    return [
        pb.ToolCallDelta(index=p["index"], id=p.get("id", ""), name=p.get("name", ""), arguments=p["arguments"])
        for p in pieces
    ]


def settings_from_proto(msg: pb.Settings, base: SamplingSettings) -> SamplingSettings:
    """Layer the fields present in ``msg`` over ``base`` (validation happens in SamplingSettings).

    Present means what protobuf lists: an ``optional`` field that was set, a non-empty ``stop``.
    """
    given: dict[str, Any] = {field.name: value for field, value in msg.ListFields()}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    if not given:
        return base
    try:
        return base.merged(**given)
    except InvalidArgument as e:
        raise InvalidArgument(e.message, reason="INVALID_SETTING", field=_culprit(base, given)) from e


def _culprit(base: SamplingSettings, given: dict[str, Any]) -> str | None:
    """The first setting that is invalid on its own (``settings.<name>``), for BadRequest: found
    by validating the fields one by one, not by reading the message."""
    for name, value in given.items():
        try:
            base.merged(**{name: value})
        except InvalidArgument:
            return f"settings.{name}"
    return None  # only a combination is invalid


def has_settings(msg: pb.Settings) -> bool:
    return bool(msg.ListFields())


def settings_to_proto(s: SamplingSettings) -> pb.Settings:
    """Every field set (``seed`` only when fixed: absent means a fresh seed per turn)."""
    out = pb.Settings(stop=list(s.stop))
    for name in _SETTING_FIELDS:
        value = getattr(s, name)
        if value is not None:
            setattr(out, name, value)
    return out


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        cached_tokens=u.cached_tokens,
        restored_tokens=u.restored_tokens,
        prefilled_tokens=u.prefilled_tokens,
        completion_tokens=u.completion_tokens,
    )


def timings_to_proto(t: Timings) -> pb.Timings:
    return pb.Timings(
        queue_ms=t.queue_ms,
        prefill_ms=t.prefill_ms,
        time_to_first_token_ms=t.time_to_first_token_ms,
        decode_ms=t.decode_ms,
    )


def logprobs_to_proto(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token=lp.token,
            piece=lp.piece,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token=t, piece=p, logprob=v) for t, p, v in lp.top],
        )
        for lp in logprobs
    ]


def chunk_to_proto(c: Chunk, served_by: pb.ServedBy) -> spb.GenerateChunk:
    if not c.final:
        out = spb.GenerateChunk(text=c.text)
        if c.logprobs:
            out.logprobs.extend(logprobs_to_proto(c.logprobs))
        return out
    assert c.usage is not None and c.timings is not None and c.finish_reason is not None
    by = pb.ServedBy()
    by.CopyFrom(served_by)
    by.cache_hit = c.cache_hit
    return spb.GenerateChunk(
        text=c.text,
        finish_reason=_FINISH[c.finish_reason],
        usage=usage_to_proto(c.usage),
        timings=timings_to_proto(c.timings),
        served_by=by,
        logprobs=logprobs_to_proto(c.logprobs or ()),
    )
