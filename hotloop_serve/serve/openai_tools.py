"""Tool calling on the OpenAI APIs: the request's tools checked, the reply constrained and parsed.

The receiving replica turns ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into
:class:`ToolSpec` s, a :class:`ToolChoice` and, when the reply may hold calls, a grammar in the
settings (``engine/tool_grammar.py``), refusing with a 400 naming the field whatever it cannot
honour. The owner renders the tools into the prompt (the engine's chat template) and splits
the reply into text and calls as it streams (:class:`ReplyCalls`), so both the HTTP replica
that answers and any API built on these items (chat completions, responses) see calls, never
their syntax.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hotloop_serve.engine.grammar import MAX_GRAMMAR_BYTES, schema_to_grammar
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.tool_grammar import tool_grammar
from hotloop_serve.engine.tool_parser import Parsed, ToolCallParser
from hotloop_serve.engine.tools import TOOL_NAME, ToolCall, ToolChoice, ToolFormat, ToolSpec
from hotloop_serve.errors import InvalidArgument
from hotloop_serve.serve.openai_schema import ChatCompletionRequest, NamedToolChoice

MAX_TOOLS = 64
"""Most tools one request may offer (each is a grammar of its own in the reply's)."""


def tool_spec(name: str, description: str | None, parameters: dict[str, Any] | None, where: str) -> ToolSpec:
    """One function tool, checked: a valid name and an object schema (``where``: its field)."""
    if not TOOL_NAME.match(name):
        raise InvalidArgument(
            f"{where}.name: {name[:80]!r} is not a valid function name (1-64 of a-z, A-Z, 0-9, _ and -)",
            field=f"{where}.name",
        )
    params = parameters if parameters is not None else {"type": "object", "properties": {}}
    kind = params.get("type", "object")
    if kind != "object":
        raise InvalidArgument(
            f"{where}.parameters: must be a JSON Schema of type object (the arguments), got type {kind!r}",
            field=f"{where}.parameters",
        )
    return ToolSpec(name, description or "", json.dumps(params, ensure_ascii=False))


def tool_choice_of(tools: Sequence[ToolSpec], choice: str | None, named: str | None, field: str) -> ToolChoice:
    """The choice (``auto`` with tools, ``none`` without, as OpenAI defaults), checked against the tools."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: at most {MAX_TOOLS} tools per request, got {len(tools)}", field="tools")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidArgument(f"tools: two tools are named {dup!r}", field="tools")
    if named is not None:
        if named not in names:
            listed = ", ".join(names) or "none"
            raise InvalidArgument(f"{field}: no tool named {named[:80]!r} among tools ({listed})", field=field)
        return ToolChoice("required", named)
    mode = choice or ("auto" if tools else "none")
    if mode == "required" and not tools:
        raise InvalidArgument(f"{field}: 'required' needs tools to call", field=field)
    return ToolChoice(mode)


def constrain(
    settings: SamplingSettings,
    fmt: ToolFormat | None,
    tools: Sequence[ToolSpec],
    choice: ToolChoice,
    parallel: bool,
    tool_path: str = "tools.{}.function",
) -> SamplingSettings:
    """``settings`` with the grammar the reply's calls must match (unchanged with no calls). A
    response format (``json_schema``) joins it: it constrains a reply without calls."""
    if not tools:
        return settings
    if fmt is None:
        raise InvalidArgument(
            "tools: this model's chat template has no tool-calling syntax this server knows "
            "(built in: gemma, hermes/chatml, llama3; docs/openai.md)",
            field="tools",
        )
    if not choice.calls:
        return settings
    if settings.grammar:
        raise InvalidArgument("grammar and tools are exclusive unless tool_choice is 'none'", field="grammar")
    answer = schema_to_grammar(settings.json_schema) if settings.json_schema and choice.mode == "auto" else None
    for i, tool in enumerate(tools):
        try:
            schema_to_grammar(tool.parameters)
        except InvalidArgument as e:
            where = tool_path.format(i) + ".parameters"
            detail = e.message.removeprefix("json_schema ")
            raise InvalidArgument(f"{where}: the schema {detail}", field=where) from e
    grammar = tool_grammar(fmt, tools, choice, parallel, answer)
    if grammar is None:
        return settings
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidArgument(
            f"tools: the grammar built from the tools' schemas is {len(grammar.encode())} bytes, over this "
            f"server's {MAX_GRAMMAR_BYTES}; offer fewer or smaller tools",
            field="tools",
        )
    try:  # the answer's schema is in the grammar now (a reply of calls has none)
        return settings.merged(grammar=grammar, json_schema="")
    except InvalidArgument as e:  # a converter output llama.cpp's parser refuses: name the tools
        raise InvalidArgument(f"tools: the tools' schemas make no valid grammar ({e.message})", field="tools") from e


class ReplyCalls:
    """The owner's view of a reply that may hold calls: engine text in, items out (``text``
    and ``tool_calls`` pieces, as ``openai_http`` streams them)."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[ToolSpec], choice: ToolChoice) -> None:
        names = [t.name for t in tools if choice.name is None or t.name == choice.name]
        self._parser = ToolCallParser(fmt, names)

    def item(self, text: str, final: bool) -> dict[str, Any]:
        parsed = self._parser.feed(text)
        if final:
            parsed.extend(self._parser.finish())
        return item_of(parsed)

    @property
    def calls(self) -> list[ToolCall]:
        """The reply's calls so far (the last one may still be growing)."""
        return self._parser.calls

    def finish_reason(self, engine_reason: str, default: str) -> str:
        """``tool_calls`` for a reply that ended after complete calls; else the usual reason."""
        return "tool_calls" if engine_reason in ("eos", "stop") and self._parser.complete else default


def item_of(parsed: Parsed) -> dict[str, Any]:
    item: dict[str, Any] = {"text": parsed.content}
    if parsed.calls:
        calls = []
        for d in parsed.calls:
            call: dict[str, Any] = {"index": d.index, "arguments": d.arguments}
            if d.id is not None:
                call["id"], call["name"] = d.id, d.name
            calls.append(call)
        item["tool_calls"] = calls
    return item


def chat_tools(req: ChatCompletionRequest) -> tuple[tuple[ToolSpec, ...], ToolChoice, bool]:
    """A chat completion's (tools, tool choice, parallel calls allowed), checked."""
    tools = tuple(
        tool_spec(t.function.name, t.function.description, t.function.parameters, f"tools.{i}.function")
        for i, t in enumerate(req.tools or ())
    )
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    mode = choice if isinstance(choice, str) else None
    return tools, tool_choice_of(tools, mode, named, "tool_choice"), req.parallel_tool_calls is not False
