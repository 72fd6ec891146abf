"""Tools on the OpenAI chat-completions request: checked, constrained, and the reply's items."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.tools import GEMMA, ToolCall, ToolChoice
from hotloop_serve.errors import InvalidArgument
from hotloop_serve.serve import openai_schema as oa
from hotloop_serve.serve.openai_tools import ReplyCalls, chat_tools, constrain

DEFAULTS = SamplingSettings(temperature=0.8, sample_len=256)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def fn(name: str, parameters: object = CITY) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}


def request(**fields: object) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return oa.parse_request(json.dumps(body).encode())


def plan(**fields: object) -> tuple[SamplingSettings, ToolChoice]:
    req = request(**fields)
    tools, choice, parallel = chat_tools(req)
    return constrain(oa.settings_of(req, DEFAULTS), GEMMA, tools, choice, parallel), choice


def test_tools_default_to_auto_and_constrain_the_reply_unless_none() -> None:
    settings, choice = plan(tools=[fn("get_weather")])
    assert choice == ToolChoice("auto") and "text-0" in settings.grammar
    settings, choice = plan(tools=[fn("get_weather")], tool_choice="required", parallel_tool_calls=False)
    assert choice == ToolChoice("required") and settings.grammar.startswith("t0-root") is False
    assert "{0," not in settings.grammar  # one call only
    settings, choice = plan(tools=[fn("a"), fn("b")], tool_choice={"type": "function", "function": {"name": "b"}})
    assert choice == ToolChoice("required", "b") and "t0-" not in settings.grammar and "t1-root" in settings.grammar
    settings, choice = plan(tools=[fn("get_weather")], tool_choice="none")
    assert choice == ToolChoice("none") and settings.grammar == ""
    assert plan()[1] == ToolChoice("none")


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"tools": [fn("a")], "tool_choice": {"type": "function", "function": {"name": "zz"}}},
            "tool_choice",
            "no tool named 'zz'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [fn("bad name!")]}, "tools.0.function.name", "not a valid function name"),
        ({"tools": [fn("a"), fn("a")]}, "tools", "two tools are named 'a'"),
        ({"tools": [fn("a", {"type": "string"})]}, "tools.0.function.parameters", "type object"),
        (
            {"tools": [fn("a", {"type": "object", "properties": {"x": {"type": "nonsense"}}})]},
            "tools.0.function.parameters",
            "not supported",
        ),
        ({"tools": [fn("a")], "grammar": 'root ::= "x"'}, "grammar", "exclusive"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(fields: dict[str, object], param: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        plan(**fields)
    assert info.value.field == param and says in info.value.message


def test_an_unknown_template_refuses_tools_but_not_tool_choice_none_without_tools() -> None:
    req = request(tools=[fn("a")])
    tools, choice, parallel = chat_tools(req)
    with pytest.raises(InvalidArgument, match="no tool-calling syntax") as info:
        constrain(DEFAULTS, None, tools, choice, parallel)
    assert info.value.field == "tools"
    assert constrain(DEFAULTS, None, (), ToolChoice("none"), True) is DEFAULTS


def test_tool_messages_must_answer_an_earlier_call() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"city": "x"}'}}
    good = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert oa.messages_of(request(messages=good), 10) == [
        M("user", "hi"),
        M("assistant", "", tool_calls=(ToolCall("c1", "a", '{"city": "x"}'),)),
        M("tool", "ok", tool_call_id="c1", name="a"),
    ]
    for bad, param in [
        ([*good[:2], {"role": "tool", "tool_call_id": "c2", "content": "ok"}], "messages.2.tool_call_id"),
        ([good[0], {"role": "tool", "content": "ok"}], "messages.1.tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "messages.0.tool_calls"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            oa.messages_of(request(messages=bad), 10)
        assert info.value.field == param


def test_reply_items_carry_text_then_call_pieces_and_the_finish_reason() -> None:
    from hotloop_serve.engine.tools import ToolSpec

    calls = ReplyCalls(GEMMA, [ToolSpec("get_weather")], ToolChoice("auto"))
    text = "Checking.\n" + GEMMA.call_text("get_weather", '{"city": "Oslo"}')
    items = [calls.item(text[i : i + 7], final=i + 7 >= len(text)) for i in range(0, len(text), 7)]
    assert "".join(i["text"] for i in items) == "Checking.\n"
    pieces = [p for i in items for p in i.get("tool_calls", [])]
    assert pieces[0]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert "".join(p["arguments"] for p in pieces) == '{"city": "Oslo"}'
    assert calls.finish_reason("eos", "stop") == "tool_calls"
    assert calls.finish_reason("length", "length") == "length"


def test_a_response_format_with_tools_constrains_the_answer_and_required_drops_it() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}}
    settings, _ = plan(tools=[fn("a")], response_format=fmt)
    assert settings.json_schema == "" and "root ::= answer-root | " in settings.grammar
    settings, _ = plan(tools=[fn("a")], response_format=fmt, tool_choice="required")
    assert settings.json_schema == "" and "answer-" not in settings.grammar
    settings, _ = plan(tools=[fn("a")], response_format=fmt, tool_choice="none")
    assert json.loads(settings.json_schema) == CITY and settings.grammar == ""
