"""The OpenAI request mapping, conversation keys and error bodies (no server)."""

from __future__ import annotations

import json

import pytest

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import InvalidArgument, NotFound, OutOfRange, Unauthenticated
from hotloop_serve.serve import openai_schema as oa

DEFAULTS = SamplingSettings(temperature=0.8, sample_len=256)


def request(**fields: object) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return oa.parse_request(json.dumps(body).encode())


def test_fields_map_onto_the_engine_settings() -> None:
    s = oa.settings_of(
        request(max_tokens=9, temperature=0, top_p=0.5, seed=-1, stop="END", logprobs=True, top_logprobs=2), DEFAULTS
    )
    assert (s.sample_len, s.temperature, s.top_p, s.seed, s.stop) == (9, 0, 0.5, 2**64 - 1, ("END",))
    assert (s.logprobs, s.top_logprobs) == (True, 2)
    assert oa.settings_of(request(max_tokens=9, max_completion_tokens=5), DEFAULTS).sample_len == 5
    assert oa.settings_of(request(), DEFAULTS) == DEFAULTS
    assert oa.settings_of(request(response_format={"type": "json_object"}), DEFAULTS).json_schema == oa.ANY_JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert json.loads(oa.settings_of(request(response_format=fmt), DEFAULTS).json_schema) == schema
    assert oa.settings_of(request(grammar='root ::= "a"', top_k=3, min_p=0.1), DEFAULTS).top_k == 3


def test_messages_developer_is_system_and_text_parts_join() -> None:
    req = request(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert oa.messages_of(req, 10) == [M("system", "be brief"), M("user", "ab")]
    with pytest.raises(InvalidArgument, match="at most 1"):
        oa.messages_of(req, 1)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"n": 9}, "n: must be between 1 and 8, got 9"),
        ({"n": 0}, "n: must be between 1 and 8"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"presence_penalty": 0.5}, "repeat_penalty"),
        ({"top_logprobs": 2}, "requires logprobs"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema is required"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "exclusive"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format."),
        ({"max_tokens": 0}, "max_completion_tokens must be >= 1"),
        ({"temperature": 3}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        oa.settings_of(request(**fields), DEFAULTS)
    assert says in info.value.message


def test_a_body_that_is_not_json_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        oa.parse_request(b"{nope")
    with pytest.raises(InvalidArgument, match="JSON object"):
        oa.parse_request(b"[1]")


def test_a_conversation_keeps_its_key_as_it_grows_and_principals_never_share_one() -> None:
    opening = [M("system", "s"), M("user", "first")]
    later = [*opening, M("assistant", "reply"), M("user", "second")]
    key = oa.conversation_key("alice", "m", opening, None)
    assert key == oa.conversation_key("alice", "m", later, None)
    assert key != oa.conversation_key("bob", "m", opening, None)
    assert key != oa.conversation_key("alice", "m", [M("system", "s"), M("user", "other")], None)
    by_header = oa.conversation_key("alice", "m", opening, "chat-1")
    assert by_header == oa.conversation_key("alice", "m", [M("user", "anything")], "chat-1")
    assert by_header != oa.conversation_key("bob", "m", opening, "chat-1")
    from hotloop_serve.serve.session_ids import KEY_PATTERN

    assert KEY_PATTERN.fullmatch(key) and KEY_PATTERN.fullmatch(key + "-7")


def test_errors_get_openai_bodies_and_http_statuses() -> None:
    status, body = oa.error_of(NotFound("model 'x' not found"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert oa.error_of(Unauthenticated("missing bearer token"))[0] == 401
    assert oa.error_of(OutOfRange("too long"))[1]["error"]["code"] == "context_length_exceeded"
    assert oa.error_of(oa.RequestTooLarge("big"))[0] == 413
    status, body = oa.error_of(InvalidArgument("n: only n=1", field="n"))  # any message, as sent
    assert status == 400 and body["error"] == {
        "message": "n: only n=1",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }
