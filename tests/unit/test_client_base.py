"""The SDK's no-I/O logic: value types, proto conversions, metadata, routing keys, and the
decoding of Ray Serve's ListApplications reply (generated from serve_proxy.proto, checked
here against Ray's message built independently from a descriptor)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from hotloop.v1 import common_pb2, session_pb2
from hotloop_client import Chunk, FinishReason, Message, Role, Settings
from hotloop_client._base import (
    SessionState,
    as_messages,
    call_metadata,
    chunk_from_proto,
    decode_application_names,
    new_session_key,
    settings_from_proto,
    settings_to_proto,
)

FULL = Settings(
    temperature=0.7,
    sample_len=64,
    seed=2**40,
    top_p=0.95,
    top_k=0,
    repeat_penalty=1.1,
    repeat_last_n=64,
    stop=("\n\n", "END"),
    min_p=0.05,
    truncate_history=False,
)


def test_settings_mirror_the_proto_field_for_field() -> None:
    proto_fields = {f.name for f in common_pb2.Settings.DESCRIPTOR.fields}
    assert {f.name for f in dataclasses.fields(Settings)} == proto_fields


def test_settings_round_trip_through_proto() -> None:
    assert settings_from_proto(settings_to_proto(FULL)) == FULL
    assert settings_from_proto(settings_to_proto(Settings())) == Settings()
    # Zero values are set values, not "absent": greedy decoding must survive the wire.
    pb = settings_to_proto(Settings(temperature=0.0, top_k=0))
    assert pb.HasField("temperature") and pb.HasField("top_k") and not pb.HasField("seed")


def test_settings_merge_and_normalise() -> None:
    base = Settings(temperature=0.7, seed=1, stop=["x"])  # type: ignore[arg-type]
    assert base.stop == ("x",)
    assert Settings(stop="END").stop == ("END",)  # type: ignore[arg-type]
    merged = base.merged(Settings(temperature=0.0, top_k=5))
    assert merged == Settings(temperature=0.0, seed=1, top_k=5, stop=("x",))
    assert merged.as_dict() == {"temperature": 0.0, "seed": 1, "top_k": 5, "stop": ("x",)}
    hash(merged)  # frozen and hashable


def test_history_accepts_messages_and_pairs() -> None:
    history = as_messages([Message(Role.SYSTEM, "s"), ("user", "u"), (Role.ASSISTANT, "a"), ("USER", "again")])
    assert [m.role for m in history] == [Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.USER]
    assert Message("user", "hi").role is Role.USER  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        as_messages([("robot", "x")])


def test_session_state_builds_requests_with_its_settings() -> None:
    state = SessionState(id="s-1", model="m", settings=Settings(temperature=0.5, seed=9))
    request = state.generate_request([("user", "hi")], {"seed": 10})
    assert request.session_id == "s-1"
    assert request.settings.seed == 10 and request.settings.temperature == pytest.approx(0.5)
    assert state.warmup_request([("system", "s")]).settings.seed == 9
    state.apply(session_pb2.Session(id="s-1"), Settings(top_k=3))  # server reported none
    assert state.settings == Settings(top_k=3)


def test_chunk_conversion_marks_only_the_last_chunk() -> None:
    middle = chunk_from_proto(session_pb2.GenerateChunk(text="Hel"))
    assert middle == Chunk(text="Hel")
    assert not middle.is_last
    last = chunk_from_proto(
        session_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(prompt_tokens=3))
    )
    assert last.is_last and last.finish_reason is FinishReason.STOP
    assert last.usage is not None and last.usage.prompt_tokens == 3
    assert last.timings is None and last.served_by is None


def test_session_keys_fit_the_routing_contract() -> None:
    keys = {new_session_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{8,64}", k) for k in keys)


def test_call_metadata() -> None:
    assert call_metadata("gemma", "tok") == (("application", "gemma"), ("authorization", "Bearer tok"))
    assert call_metadata(None, None) == ()


def _apps_message(names: list[str]) -> bytes:
    fdp = descriptor_pb2.FileDescriptorProto(name="apps_test.proto", package="appstest", syntax="proto3")
    msg = fdp.message_type.add(name="ListApplicationsResponse")
    msg.field.add(
        name="application_names",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    msg.field.add(name="other", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64)
    msg.field.add(name="ratio", number=3, type=descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("appstest.ListApplicationsResponse"))
    return bytes(cls(application_names=names, other=300, ratio=0.5).SerializeToString())


def test_application_names_decode_like_protobuf() -> None:
    names = ["gemma-3-270m", "ünïcode", "x" * 300]  # a >127-byte name needs a 2-byte length
    assert decode_application_names(_apps_message(names)) == names
    assert decode_application_names(b"") == []


@pytest.mark.parametrize("data", [b"\x0a\x05abc", b"\x0a", b"\x80", b"\x0f"])
def test_application_names_reject_garbage(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_application_names(data)
