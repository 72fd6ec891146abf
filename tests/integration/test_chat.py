"""The first slice end to end: SDK -> Serve's gRPC proxy -> replica -> engine -> Gemma."""

from __future__ import annotations

import threading

import grpc
import pytest
from hotloop.v1 import common_pb2, session_pb2, session_pb2_grpc
from hotloop_client import (
    Client,
    FinishReason,
    InvalidArgument,
    Message,
    NotFound,
    Role,
    Settings,
)

from .conftest import SINGLE, Server

pytestmark = pytest.mark.integration
GREEDY = Settings(temperature=0, sample_len=24)
HISTORY = [Message(Role.SYSTEM, "You are a helpful assistant."), Message(Role.USER, "Name three colours.")]


def test_model_info(client: Client) -> None:
    names = [m.name for m in client.list_models()]
    assert SINGLE in names
    info = client.model(SINGLE).info()
    assert info.architecture == "gemma3"
    assert info.quantization == "Q4_K_M"
    assert not info.has_chat_template and info.chat_template_source == "builtin:gemma"
    assert info.context_length == 4096


def test_chat_streams_chunks_and_exact_usage(client: Client) -> None:
    session = client.model(SINGLE).new_session(settings=Settings(temperature=0.7, seed=7, sample_len=32))
    # Forbid end-of-turn by asking for a long answer; the length finish proves the exact count.
    chunks = list(session.generate([Message(Role.USER, "Write a long story about the sea.")]))
    assert len(chunks) > 3
    final = chunks[-1]
    assert final.usage is not None and final.finish_reason is not None
    if final.finish_reason == FinishReason.LENGTH:
        assert final.usage.completion_tokens == 32
    assert final.usage.prompt_tokens == final.usage.prefilled_tokens > 0
    assert final.served_by is not None and final.served_by.replica
    session.close()


def test_second_turn_reuses_the_whole_first_turn(client: Client) -> None:
    session = client.model(SINGLE).new_session(settings=GREEDY)
    first = list(session.generate(HISTORY))
    reply = "".join(c.text for c in first)
    u1 = first[-1].usage
    assert u1 is not None
    history = [*HISTORY, Message(Role.ASSISTANT, reply), Message(Role.USER, "And three animals?")]
    second = list(session.generate(history))
    u2 = second[-1].usage
    assert u2 is not None
    # Every prompt token of turn 1 and every token it generated (plus its end of turn) is reused.
    assert u2.cached_tokens >= u1.prompt_tokens + u1.completion_tokens
    assert u2.cached_tokens + u2.prefilled_tokens == u2.prompt_tokens
    assert session.context() >= u2.prompt_tokens
    session.close()


def test_fixed_seed_reproduces_and_greedy_is_deterministic(client: Client) -> None:
    model = client.model(SINGLE)
    sampled = Settings(temperature=0.9, seed=1234, sample_len=20)
    texts = ["".join(c.text for c in model.new_session(settings=sampled).generate(HISTORY)) for _ in range(2)]
    assert texts[0] == texts[1]
    greedy = ["".join(c.text for c in model.new_session(settings=GREEDY).generate(HISTORY)) for _ in range(2)]
    assert greedy[0] == greedy[1]


def test_sample_len_caps_and_stop_sequences_stop(client: Client) -> None:
    model = client.model(SINGLE)
    capped = list(model.new_session(settings=Settings(temperature=0, sample_len=5)).generate(HISTORY))
    assert capped[-1].usage is not None and capped[-1].usage.completion_tokens <= 5
    free = "".join(c.text for c in model.new_session(settings=GREEDY).generate(HISTORY))
    words = free.split()
    assert len(words) >= 3
    stop = words[2]
    stopped = list(model.new_session(settings=GREEDY).generate(HISTORY, stop=(stop,)))
    text = "".join(c.text for c in stopped)
    assert stopped[-1].finish_reason == FinishReason.STOP
    assert stop not in text and free.startswith(text)


def test_two_sessions_at_once_from_two_threads_do_not_mix(client: Client) -> None:
    model = client.model(SINGLE)
    prompts = {"a": "Say the word apple.", "b": "Count from one to five."}
    alone = {k: "".join(c.text for c in model.new_session(settings=GREEDY).generate([Message(Role.USER, p)]))
             for k, p in prompts.items()}  # fmt: skip
    together: dict[str, str] = {}

    def run(k: str) -> None:
        s = model.new_session(settings=GREEDY)
        together[k] = "".join(c.text for c in s.generate([Message(Role.USER, prompts[k])]))

    threads = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def test_warmup_context_and_clear(client: Client) -> None:
    session = client.model(SINGLE).new_session(settings=GREEDY)
    usage = session.warmup([Message(Role.SYSTEM, "Always answer in JSON.")])
    assert usage.prefilled_tokens > 0 and usage.completion_tokens == 0
    assert session.context() == usage.prompt_tokens
    out = list(session.generate([Message(Role.SYSTEM, "Always answer in JSON."), Message(Role.USER, "Hi")]))
    assert out[-1].usage is not None and out[-1].usage.cached_tokens >= usage.prompt_tokens - 1
    session.clear_cache()
    assert session.context() == 0
    session.set_settings(Settings(temperature=0, sample_len=3))
    assert session.info().settings.sample_len == 3
    session.close()
    with pytest.raises(NotFound):
        session.context()


@pytest.mark.parametrize(
    ("settings", "history", "error", "message"),
    [
        (Settings(temperature=-1), HISTORY, InvalidArgument, "temperature"),
        (Settings(top_p=0), HISTORY, InvalidArgument, "top_p"),
        (Settings(top_p=1.5), HISTORY, InvalidArgument, "top_p"),
    ],
)
def test_bad_requests_get_clear_statuses(
    client: Client, settings: Settings, history: list[Message], error: type[Exception], message: str
) -> None:
    session = client.model(SINGLE).new_session(settings=GREEDY)
    with pytest.raises(error, match=message):
        list(session.generate(history, **{k: v for k, v in settings.as_dict().items() if v is not None}))
    assert list(session.generate(HISTORY))[-1].usage is not None  # still serving


def test_unknown_model_session_and_role_through_raw_grpc(server: Server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)
        md = [("application", SINGLE)]
        msg = [common_pb2.Message(role=common_pb2.ROLE_USER, content="hi")]
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(session_pb2.CreateSessionRequest(model="no-such-model"), metadata=md)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(session_pb2.GenerateRequest(session_id="nope.nope", messages=msg), metadata=md))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        sid = stub.CreateSession(session_pb2.CreateSessionRequest(model=SINGLE), metadata=md).id
        bad = [common_pb2.Message(role=common_pb2.ROLE_UNSPECIFIED, content="hi")]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(session_pb2.GenerateRequest(session_id=sid, messages=bad), metadata=md))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(session_pb2.GenerateRequest(session_id=sid, messages=[]), metadata=md))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in (e.value.details() or "")
        ok = list(stub.Generate(session_pb2.GenerateRequest(session_id=sid, messages=msg), metadata=md))
        assert ok[-1].usage.completion_tokens > 0
