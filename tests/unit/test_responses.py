"""The Responses API without a server: requests, input items, output, events, the store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.tools import ToolCall, ToolChoice
from hotloop_serve.errors import InvalidArgument, NotFound, ResourceExhausted
from hotloop_serve.serve import responses_schema as rs
from hotloop_serve.serve.responses_http import item_page
from hotloop_serve.serve.responses_store import ResponseStore, StoredResponse

DEFAULTS = SamplingSettings(temperature=0.8, sample_len=256)
KEY = "oa" + "k" * 22


def request(**fields: object) -> rs.ResponseRequest:
    return rs.parse_response_request(json.dumps({"model": "m", "input": "hi", **fields}).encode())


def test_ids_carry_their_conversations_routing_key_and_128_random_bits() -> None:
    a, b = rs.new_response_id(KEY), rs.new_response_id(KEY)
    assert a != b and rs.key_of(a) == KEY == rs.key_of(b) and len(a) == 51
    for bad in ["resp_short", "chatcmpl-" + "x" * 42, "x" * 500]:
        with pytest.raises(NotFound):
            rs.key_of(bad)


def test_input_items_become_the_conversation() -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "cold"},
        {"type": "reasoning", "summary": []},
    ]
    messages, stored = rs.conversation_of(request(input=items), (), 100)
    assert messages == [
        M("system", "be brief"),
        M("user", "weather?"),
        M("assistant", "Let me see.", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Oslo"}'),)),
        M("tool", "cold", tool_call_id="c1", name="get_weather"),
    ]
    assert [i["type"] for i in stored] == ["message"] * 3 + ["function_call", "function_call_output"]
    assert all(i["id"] for i in stored)
    assert rs.conversation_of(request(), (), 10)[0] == [M("user", "hi")]


def test_a_function_call_output_may_answer_a_call_of_the_previous_response() -> None:
    history = (M("user", "x"), M("assistant", "", tool_calls=(ToolCall("c9", "f", "{}"),)))
    out = [{"type": "function_call_output", "call_id": "c9", "output": "ok"}]
    assert rs.conversation_of(request(input=out), history, 10)[0] == [M("tool", "ok", tool_call_id="c9", name="f")]
    with pytest.raises(InvalidArgument) as info:
        rs.conversation_of(request(input=out), (), 10)
    assert info.value.field == "input.0.call_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
        ({"input": [{"type": "reasoning"}]}, "input"),
    ],
)
def test_bad_input_items_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        rs.conversation_of(request(**fields), (), 10)
    assert info.value.field == param


def test_settings_tools_and_the_echo() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = request(
        max_output_tokens=12,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "x", "schema": schema}},
        tools=[{"type": "function", "name": "f", "parameters": schema}],
        tool_choice={"type": "function", "name": "f"},
    )
    settings = rs.settings_of(req, DEFAULTS)
    assert (settings.sample_len, settings.temperature, json.loads(settings.json_schema)) == (12, 0, schema)
    tools, choice, parallel = rs.tools_of(req)
    assert [t.name for t in tools] == ["f"] and choice == ToolChoice("required", "f") and parallel
    echo = rs.echo_of(req, tools, choice)
    assert echo["tool_choice"] == {"type": "function", "name": "f"}
    assert echo["tools"][0]["name"] == "f" and echo["text"]["format"]["schema"] == schema
    with pytest.raises(InvalidArgument) as info:
        rs.settings_of(request(max_output_tokens=0), DEFAULTS)
    assert info.value.field == "max_output_tokens"
    with pytest.raises(InvalidArgument) as info:
        rs.tools_of(request(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}))
    assert info.value.field == "tool_choice"


def test_output_items_and_the_response_object() -> None:
    call = ToolCall("call_abc", "f", '{"a": 1}')
    output = rs.output_of("msg_1", "", [call])
    assert output == [
        {
            "type": "function_call",
            "id": "fc_abc",
            "call_id": "call_abc",
            "name": "f",
            "arguments": '{"a": 1}',
            "status": "completed",
        }
    ]
    assert rs.output_of("msg_1", "", [])[0]["content"][0]["text"] == ""
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 7}
    body = rs.response_json("resp_x", {"model": "m"}, "incomplete", output, usage, 5)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["created_at"] == 5
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 7 and body["usage"]["total_tokens"] == 13


def test_events_follow_the_spec_for_text_then_a_call() -> None:
    start = rs.response_json("resp_x", {}, "in_progress", [], None)
    writer = rs.EventWriter(start, "msg_1")
    events = writer.start()
    events += writer.item({"text": "Hi "})
    events += writer.item({"text": "there", "tool_calls": [{"index": 0, "id": "call_z", "name": "f", "arguments": ""}]})
    events += writer.item({"text": "", "tool_calls": [{"index": 0, "arguments": '{"a": 1}'}]})
    done = rs.response_json(
        "resp_x", {}, "completed", rs.output_of("msg_1", "Hi there", [ToolCall("call_z", "f", '{"a": 1}')]), None
    )
    events += writer.finish(done)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    data = dict(events)
    assert data["response.output_text.done"]["text"] == "Hi there"
    assert data["response.function_call_arguments.done"]["arguments"] == '{"a": 1}'
    assert events[-2][1]["output_index"] == 1 and events[-2][1]["item"]["id"] == "fc_z"


def record(rid: str, principal: str = "alice", session: str = "s1", text: str = "x") -> StoredResponse:
    body = {"output": [{"text": text}]}
    return StoredResponse(rid, principal, (M("user", text),), session, body, [{"id": "i1", "text": text}])


def test_the_store_keeps_records_per_principal_with_a_budget() -> None:
    store = ResponseStore(max_count=2, max_bytes=10_000)
    store.put(record("r1"))
    assert store.get("r1", "alice").id == "r1"
    with pytest.raises(NotFound):
        store.get("r1", "bob")  # another principal's: not found, as an unknown id
    store.check_room("alice")
    store.put(record("r2", session="s2"))
    with pytest.raises(ResourceExhausted, match="delete some"):
        store.check_room("alice")
    store.check_room("bob")
    assert store.delete("r1", "alice") == "s1"  # no other record uses s1: close its session
    store.check_room("alice")
    big = ResponseStore(max_count=100, max_bytes=1024)
    big.put(record("r3", text="y" * 2000))
    with pytest.raises(ResourceExhausted, match="bytes"):
        big.check_room("alice")


def test_heads_say_whether_continuing_extends_a_session_or_forks_it() -> None:
    store = ResponseStore(10, 10_000)
    store.put(record("r1"))
    assert store.is_head("s1", "r1")
    store.put(record("r2"))  # r1 continued in s1: s1 now ends with r2
    assert store.is_head("s1", "r2") and not store.is_head("s1", "r1")
    store.moved("s1", None)  # a store: false response ran in s1
    assert not store.is_head("s1", "r2")
    assert store.delete("r2", "alice") is None  # r1 still uses s1


def test_input_items_page() -> None:
    items = [{"id": f"i{i}"} for i in range(5)]
    page = item_page(items, 2, "desc", None)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"]
    page = item_page(items, 10, "asc", "i2")
    assert [i["id"] for i in page["data"]] == ["i3", "i4"] and not page["has_more"] and page["first_id"] == "i3"


def test_stored_responses_survive_on_disk_for_their_principal_only(tmp_path: Any) -> None:
    from hotloop_serve.serve.responses_disk import ResponseDisk

    disk = ResponseDisk(str(tmp_path))
    call = ToolCall("c1", "f", '{"a": 1}')
    messages = (M("user", "hi"), M("assistant", "", tool_calls=(call,)), M("tool", "2", tool_call_id="c1", name="f"))
    rec = StoredResponse("resp_1", "alice", messages, "s1", {"output": [], "id": "resp_1"}, [{"id": "i1"}])
    disk.save(rec)
    loaded = disk.load("resp_1", "alice")
    assert loaded is not None and loaded.messages == messages and loaded.body == rec.body
    assert (loaded.session, loaded.input_items) == ("s1", [{"id": "i1"}])
    assert disk.load("resp_1", "bob") is None and disk.load("resp_2", "alice") is None
    next(disk.directory.iterdir()).write_text("{not json")
    assert disk.load("resp_1", "alice") is None  # unreadable: a miss, not an error
    disk.remove("resp_1")
    assert not list(disk.directory.iterdir())


class FakeEngine:
    """The sessions ``responses_handover`` releases and adopts: id -> (owner, blob)."""

    def __init__(self, sessions: dict[str, tuple[str, bytes]]) -> None:
        self.sessions = dict(sessions)

    def known(self, sid: str) -> bool:
        return sid in self.sessions

    def release_session(self, sid: str, owner: str) -> bytes:
        held, blob = self.sessions.pop(sid)
        assert held == owner
        return blob

    def adopt_session(self, sid: str, owner: str, blob: bytes) -> bool:
        self.sessions[sid] = (owner, blob)
        return True


def test_a_conversation_s_records_move_with_their_sessions_and_heads() -> None:
    from hotloop_serve.serve.responses_handover import pack, unpack

    other = "B" * rs.KEY_CHARS
    r1, r2, r3 = (rs.new_response_id(KEY) for _ in range(3))
    giver, taker = ResponseStore(10, 10_000), ResponseStore(10, 10_000)
    giver.put(record(r1, session="s1"))
    giver.put(record(r2, session="s1"))  # s1 ends with r2
    giver.put(record(r3, session="fork"))  # r1 continued again: a fork, busy with a reply
    giver.put(record(rs.new_response_id(KEY), principal="bob", session="sb"))
    giver.put(record(rs.new_response_id(other), session="s9"))
    engine = FakeEngine({"s1": ("alice", b"one"), "fork": ("alice", b"two"), "s9": ("alice", b"nine")})
    parcel = pack(giver, engine, KEY, "alice", busy={"fork"})  # type: ignore[arg-type]
    assert [r.id for r in parcel.records] == [r1, r2, r3] and parcel.sessions == [("s1", "alice", b"one")]
    assert set(engine.sessions) == {"fork", "s9"}  # s1 released; the busy fork stays
    with pytest.raises(NotFound):
        giver.get(r1, "alice")
    assert giver.keys() == {KEY, other}  # bob's record of KEY and the other conversation stay
    receiver = FakeEngine({})
    assert unpack(taker, receiver, parcel) == ["s1"]  # type: ignore[arg-type]
    assert taker.get(r2, "alice").session == "s1" and taker.is_head("s1", r2) and not taker.is_head("s1", r1)
    assert taker.is_head("fork", r3) and taker.usage("alice")[0] == 3 and giver.usage("alice")[0] == 1
    unpack(taker, receiver, parcel)  # type: ignore[arg-type]
    assert taker.usage("alice")[0] == 3  # a record held already is not counted twice


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"include": ["reasoning.encrypted_content", "nonsense"]}, "include.1", "unknown value 'nonsense'"),
        ({"include": ["message.output_text.logprobs"]}, "include.0", "not supported"),
        ({"conversation": "conv_123"}, "conversation", "previous_response_id"),
        ({"conversation": {"id": "conv_123"}}, "conversation", "Conversations API"),
        ({"background": True}, "background", "stream: true"),
    ],
)
def test_include_conversation_and_background_are_honoured_or_refused_never_dropped(
    fields: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": "m", "input": "hi", **fields}
    with pytest.raises(InvalidArgument, match=says) as info:
        rs.parse_response_request(json.dumps(body).encode())
    assert info.value.field == param


def test_include_values_about_items_this_server_never_makes_are_accepted() -> None:
    known = sorted(rs.INCLUDE_NOTHING)
    req = rs.parse_response_request(json.dumps({"model": "m", "input": "hi", "include": known}).encode())
    assert req.include == known


def test_the_llama_cpp_sampling_extensions_reach_the_settings_as_in_chat_completions() -> None:
    """Found by the chaos soak: ``repeat_penalty`` (and its siblings) were silently ignored by
    /v1/responses, so a greedy reply there was not the one chat completions gave for the same
    conversation and settings."""
    defaults = SamplingSettings()
    req = rs.ResponseRequest(
        model="m", input="hi", temperature=0, repeat_penalty=1.0, repeat_last_n=32, top_k=5, min_p=0.1, seed=9
    )
    s = rs.settings_of(req, defaults)
    assert (s.repeat_penalty, s.repeat_last_n, s.top_k, s.min_p, s.seed) == (1.0, 32, 5, 0.1, 9)
    assert rs.settings_of(rs.ResponseRequest(model="m", input="hi"), defaults) == defaults
