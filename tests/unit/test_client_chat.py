"""``hotloop chat`` driven by scripted input against a real in-process gRPC server.

The server is an "echo model": it replies ``echo: <last user message>`` in chunks, so the
tests can check what the chat prints, what history it sends each turn, and what its slash
commands do on the wire.
"""

from __future__ import annotations

import dataclasses
import io
import re
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from hotloop.v1 import common_pb2, model_pb2, model_pb2_grpc, session_pb2, session_pb2_grpc
from hotloop_client import Settings
from rich.console import Console
from typer.testing import CliRunner

from hotloop_serve.cli import chat as chat_cli

MODEL = "echo-1"


class EchoServer(session_pb2_grpc.SessionServiceServicer, model_pb2_grpc.ModelServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.models = [MODEL]
        self.cancelled = threading.Event()
        self.settings = common_pb2.Settings()

    def of(self, method: str) -> list[Any]:
        return [r for m, r in self.requests if m == method]

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        return model_pb2.ListModelsResponse(models=[model_pb2.ModelInfo(name=n) for n in self.models])

    def CreateSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("CreateSession", request))
        self.settings.CopyFrom(request.settings)
        return session_pb2.Session(id="s-1", model=request.model, settings=self.settings)

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.requests.append(("Generate", request))
        finished = threading.Event()
        # Runs when the RPC ends; only an end before the reply finished is a cancellation.
        context.add_callback(lambda: None if finished.is_set() else self.cancelled.set())
        text = request.messages[-1].content
        yield session_pb2.GenerateChunk(text="echo: ")
        yield session_pb2.GenerateChunk(text=text)
        if "BOOM" in text:  # a long reply: only ends when the client cancels it
            self.cancelled.wait(5)
            return
        yield session_pb2.GenerateChunk(
            finish_reason=common_pb2.FINISH_REASON_EOS,
            usage=common_pb2.Usage(prompt_tokens=20, cached_tokens=12, completion_tokens=5),
            timings=common_pb2.Timings(time_to_first_token_ms=42.0, decode_ms=100.0),
            served_by=common_pb2.ServedBy(replica="r0", cache_hit=True),
        )
        finished.set()

    def Warmup(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("Warmup", request))
        return session_pb2.WarmupResponse(usage=common_pb2.Usage(prompt_tokens=9))

    def GetSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        return session_pb2.Session(id=request.session_id, context_tokens=321)

    def UpdateSettings(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("UpdateSettings", request))
        if request.settings.HasField("temperature") and request.settings.temperature > 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be <= 2")
        self.settings.CopyFrom(request.settings)
        return session_pb2.Session(id=request.session_id, settings=self.settings)

    def ClearCache(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("ClearCache", request))
        return session_pb2.Session(id=request.session_id)

    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("CloseSession", request))
        return session_pb2.CloseSessionResponse()


@pytest.fixture
def echo() -> Iterator[tuple[str, EchoServer]]:
    servicer = EchoServer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    session_pb2_grpc.add_SessionServiceServicer_to_server(servicer, srv)
    model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        srv.stop(None).wait(5)


def lines(*items: str | BaseException) -> chat_cli.ReadLine:
    """A read_line that returns (or raises) the given items, then EOF."""
    queue = list(items)

    def read() -> str:
        if not queue:
            raise EOFError
        item = queue.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    return read


def run(address: str, *inputs: str | BaseException, file: io.StringIO | None = None, **kwargs: Any) -> tuple[int, str]:
    out = file or io.StringIO()
    console = Console(file=out, width=200, color_system=None, highlight=False)
    code = chat_cli.run_chat(address, console=console, read_line=lines(*inputs), **kwargs)
    return code, out.getvalue()


def test_conversation_keeps_history_and_prints_stats(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    code, out = run(address, "hello", "", "more", "/quit", "never read")
    assert code == 0
    assert "echo-1> echo: hello" in out
    assert "5 tokens · prompt 20 (12 cached) · 40.0 tok/s · TTFT 42 ms · replica r0 (cache hit)" in out
    first, second = server.of("Generate")
    assert [m.content for m in first.messages] == ["hello"]
    assert [(m.role, m.content) for m in second.messages] == [
        (common_pb2.ROLE_USER, "hello"),
        (common_pb2.ROLE_ASSISTANT, "echo: hello"),
        (common_pb2.ROLE_USER, "more"),
    ]
    assert len(server.of("CloseSession")) == 1


def test_system_prompt_settings_and_commands(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    code, out = run(
        address,
        "hi",
        "/system be brief",
        "/set temperature 0.25",
        "/set temperature 9",
        "/set top_k lots",
        '/set stop ["END", "\\n\\n"]',
        "/settings",
        "again",
        "/context",
        "/clear",
        "/help",
        "/bogus",
        model=MODEL,
        system="you are terse",
        settings=Settings(seed=7),
    )
    assert code == 0
    warmups = server.of("Warmup")
    assert [w.messages[0].content for w in warmups] == ["you are terse", "be brief", "be brief"]
    assert server.of("CreateSession")[0].settings.seed == 7
    last = server.of("Generate")[-1]
    # /system cleared the history; the new prompt leads; /set changed the turn's settings.
    assert [m.content for m in last.messages] == ["be brief", "again"]
    assert last.settings.temperature == pytest.approx(0.25)
    assert list(last.settings.stop) == ["END", "\n\n"]
    assert last.settings.seed == 7
    assert "INVALID_ARGUMENT: temperature must be <= 2" in out
    assert "bad value for top_k" in out
    assert "321 tokens" in out
    assert len(server.of("ClearCache")) == 1
    assert "/system <text>" in out and "unknown command /bogus" in out
    assert re.search(r"^temperature\s+0\.25\s*$", out, flags=re.MULTILINE)


def test_ctrl_c_during_a_reply_cancels_it_and_keeps_history(echo: tuple[str, EchoServer]) -> None:
    address, server = echo

    class InterruptingFile(io.StringIO):
        """Raises KeyboardInterrupt (once) when the reply containing BOOM is printed."""

        fired = False

        def write(self, s: str) -> int:
            if "BOOM" in s and not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return super().write(s)

    out = InterruptingFile()
    code, text = run(address, "first", "BOOM", "after", file=out)
    assert code == 0
    assert "[cancelled]" in text
    assert server.cancelled.wait(2)
    last = server.of("Generate")[-1]
    assert [m.content for m in last.messages] == ["first", "echo: first", "after"]


def test_ctrl_c_at_the_prompt_leaves(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    code, _ = run(address, KeyboardInterrupt(), "never read")
    assert code == 0
    assert not server.of("Generate")
    assert len(server.of("CloseSession")) == 1


def test_no_models_or_no_server_is_an_error(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    server.models = []
    code, out = run(address)
    assert code == 1 and "no models" in out
    code, out = run("127.0.0.1:1", model=MODEL)
    assert code == 1 and "UNAVAILABLE" in out


def test_console_script_with_piped_stdin(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    args = ["--address", address, "--temperature", "0.3", "--seed", "5", "--sample-len", "16", "--system", "sys"]
    result = CliRunner().invoke(chat_cli.app, args, input="hi\n/quit\n")
    assert result.exit_code == 0, result.output
    assert "you> hi" in result.output and "echo: hi" in result.output
    created = server.of("CreateSession")[0]
    assert created.model == MODEL
    assert created.settings.temperature == pytest.approx(0.3)
    assert created.settings.seed == 5 and created.settings.sample_len == 16
    assert server.of("Warmup")[0].messages[0].content == "sys"


def test_main_accepts_the_chat_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        chat_cli.main(["chat", "--help"])
    assert exit_info.value.code == 0
    assert "--address" in capsys.readouterr().out


def test_set_parses_every_settings_field_by_its_type() -> None:
    # The parsers come from the Settings dataclass (the SDK's mirror of hotloop.v1.Settings):
    # a field added to the proto is settable with /set without a list edited in the chat.
    assert set(chat_cli._PARSERS) == {f.name for f in dataclasses.fields(Settings)}
    assert chat_cli.parse_setting("temperature", "0.2") == ("temperature", 0.2)
    assert chat_cli.parse_setting("top-k", "5") == ("top_k", 5)
    assert chat_cli.parse_setting("truncate_history", "yes") == ("truncate_history", True)
    assert chat_cli.parse_setting("stop", '["\\n\\n", "END"]') == ("stop", ("\n\n", "END"))
    assert chat_cli.parse_setting("json_schema", '{"type": "object"}') == ("json_schema", '{"type": "object"}')
    assert chat_cli.parse_setting("seed", "random") == ("seed", None)
    with pytest.raises(ValueError, match="unknown setting"):
        chat_cli.parse_setting("nope", "1")
