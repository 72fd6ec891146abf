"""Tools over gRPC on the server: the history's calls and results, a Generate's tools, call deltas."""

from __future__ import annotations

import json

import pytest
from hotloop.v1 import common_pb2 as pb
from hotloop.v1 import session_pb2 as spb

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.tools import ToolCall, ToolChoice
from hotloop_serve.errors import InvalidArgument
from hotloop_serve.serve import convert

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


def test_calls_and_results_in_the_history() -> None:
    history = [
        pb.Message(role=pb.ROLE_USER, content="hi"),
        pb.Message(role=pb.ROLE_ASSISTANT, tool_calls=[pb.ToolCall(id="c1", name="f", arguments='{"a": 1}')]),
        pb.Message(role=pb.ROLE_TOOL, content="2", tool_call_id="c1"),
    ]
    assert convert.messages_from_proto(history, 10) == [
        M("user", "hi"),
        M("assistant", "", tool_calls=(ToolCall("c1", "f", '{"a": 1}'),)),
        M("tool", "2", tool_call_id="c1", name="f"),
    ]
    for bad, field in [
        ([pb.Message(role=pb.ROLE_TOOL, content="2", tool_call_id="c9")], "messages[0].tool_call_id"),
        ([pb.Message(role=pb.ROLE_USER, tool_calls=[pb.ToolCall(id="c", name="f")])], "messages[0].tool_calls"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            convert.messages_from_proto(bad, 10)
        assert info.value.field == field


def test_a_generates_tools_and_choice() -> None:
    request = spb.GenerateRequest(tools=[pb.Tool(name="f", parameters=SCHEMA), pb.Tool(name="g")], tool_choice="g")
    tools, choice, parallel = convert.tools_from_proto(request)
    assert [t.name for t in tools] == ["f", "g"] and choice == ToolChoice("required", "g") and parallel
    assert json.loads(tools[1].parameters) == {"type": "object", "properties": {}}
    request = spb.GenerateRequest(tools=[pb.Tool(name="f")], parallel_tool_calls=False)
    assert convert.tools_from_proto(request)[1:] == (ToolChoice("auto"), False)
    assert convert.tools_from_proto(spb.GenerateRequest())[1] == ToolChoice("none")
    for bad, field in [
        (spb.GenerateRequest(tools=[pb.Tool(name="f", parameters="{nope")]), "tools[0].parameters"),
        (spb.GenerateRequest(tools=[pb.Tool(name="f", parameters="[1]")]), "tools[0].parameters"),
        (spb.GenerateRequest(tools=[pb.Tool(name="no spaces")]), "tools[0].name"),
        (spb.GenerateRequest(tools=[pb.Tool(name="f")], tool_choice="h"), "tool_choice"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            convert.tools_from_proto(bad)
        assert info.value.field == field


def test_call_pieces_become_deltas() -> None:
    pieces = [{"index": 0, "id": "call_1", "name": "f", "arguments": ""}, {"index": 0, "arguments": "{}"}]
    first, second = convert.tool_calls_to_proto(pieces)
    assert (first.index, first.id, first.name, first.arguments) == (0, "call_1", "f", "")
    assert (second.id, second.name, second.arguments) == ("", "", "{}")
