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
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
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
        self.forks = 0
        self.fork_fails = False
        self.listed = True

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
        if request.tools and request.messages[-1].role != common_pb2.ROLE_TOOL:  # call the first tool
            delta = common_pb2.ToolCallDelta
            yield session_pb2.GenerateChunk(tool_calls=[delta(index=0, id="call_7", name=request.tools[0].name)])
            yield session_pb2.GenerateChunk(tool_calls=[delta(index=0, arguments='{"x": 1}')])
            yield session_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS)
            finished.set()
            return
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

    def ForkSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("ForkSession", request))
        if self.fork_fails:
            context.abort(grpc.StatusCode.NOT_FOUND, "session has no cache on this server (it was never used)")
        self.forks += 1
        return session_pb2.Session(id=f"fork-{self.forks}", model=MODEL, settings=request.settings)

    def ListSessions(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("ListSessions", request))
        if not self.listed:
            return session_pb2.ListSessionsResponse()
        return session_pb2.ListSessionsResponse(
            sessions=[
                session_pb2.Session(
                    id="s-1",
                    state="hot",
                    context_tokens=42,
                    last_used_unix=time.time() - 30,
                    served_by=common_pb2.ServedBy(replica="r0"),
                ),
                session_pb2.Session(id="elsewhere-9", state="evicted", context_tokens=7),
            ]
        )

    @staticmethod
    def blob(session_id: str) -> bytes:
        return b"BLOB:" + session_id.encode() + bytes(range(256)) * 8

    def ExportSession(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.requests.append(("ExportSession", request))
        blob = self.blob(request.session_id)
        yield session_pb2.ExportSessionChunk(data=blob[:1000], total_bytes=len(blob))
        yield session_pb2.ExportSessionChunk(data=blob[1000:], total_bytes=len(blob))

    def ImportSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(("ImportSession", request))
        if not request.data.startswith(b"BLOB:"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not an exported session (damaged?)")
        return session_pb2.Session(id="imported-1", model=MODEL, settings=request.settings)


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


def sent(server: EchoServer, method: str = "Generate") -> list[tuple[str, list[str]]]:
    """(session id, message contents) of each recorded request of ``method``."""
    return [(r.session_id, [m.content for m in r.messages]) for r in server.of(method)]


def test_regenerate_and_edit_rewind_the_history(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    code, out = run(
        address,
        "/regenerate",
        "one",
        "two",
        "/regenerate",
        "/history",
        "/edit 1 uno",
        "/edit 2 my own reply",
        "three",
        "/edit 9 nine",
        "/edit two x",
        "/edit",
        "/history",
        system="sys",
    )
    assert code == 0
    assert "no reply to regenerate yet" in out
    # The client owns the history: a rewind is a shorter or edited history, sent whole.
    assert sent(server) == [
        ("s-1", ["sys", "one"]),
        ("s-1", ["sys", "one", "echo: one", "two"]),
        ("s-1", ["sys", "one", "echo: one", "two"]),  # /regenerate: the last reply dropped
        ("s-1", ["sys", "uno"]),  # /edit 1: message 1 replaced, what followed dropped
        ("s-1", ["sys", "uno", "my own reply", "three"]),  # /edit 2 (a reply): taken as written
    ]
    assert "  3 user: two" in out and "  4 assistant: echo: two" in out and "   system: sys" in out
    assert "reply 2 replaced" in out
    assert "no message '9': /history numbers them 1 to 4" in out
    assert "no message 'two'" in out and "usage: /edit <k> <text>" in out
    assert out.rstrip().endswith("4 assistant: echo: three")


def test_fork_switch_and_sessions(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    code, out = run(
        address,
        "hi",
        "/fork",
        "left",
        "/switch",
        "/switch 1",
        "right",
        "/fork 1",
        "again",
        "/sessions",
        "/switch 7",
        model=MODEL,
        settings=Settings(seed=3),
    )
    assert code == 0
    forks = server.of("ForkSession")
    assert [f.session_id for f in forks] == ["s-1", "s-1"]
    assert [m.content for m in forks[0].messages] == ["hi", "echo: hi"]  # the whole conversation
    assert [m.content for m in forks[1].messages] == ["hi"]  # up to message 1
    assert all(f.settings.seed == 3 for f in forks)
    assert sent(server) == [
        ("s-1", ["hi"]),
        ("fork-1", ["hi", "echo: hi", "left"]),
        ("s-1", ["hi", "echo: hi", "right"]),  # the old session is still there
        ("fork-2", ["hi", "again"]),
    ]
    assert "forked session 1: now in session 2 (fork-1)" in out
    assert re.search(r"^\* 2  fork-1  4 messages", out, flags=re.MULTILINE)
    assert re.search(r"^  1  s-1  2 messages", out, flags=re.MULTILINE)
    assert "now in session 1 (s-1, 2 messages)" in out
    assert "forked session 1: now in session 3 (fork-2)" in out
    # /sessions: the server's list, the chat's own sessions marked.
    assert len(server.of("ListSessions")) == 1 and server.of("ListSessions")[0].model == MODEL
    assert re.search(r"^1\s+s-1\s+hot\s+42\s+3\d s ago\s+r0", out, flags=re.MULTILINE), out
    assert re.search(r"^\s+elsewhere-9\s+evicted\s+7\s+never", out, flags=re.MULTILINE), out
    assert "no session '7': /switch lists 1 to 3" in out
    # Leaving closes every session the chat opened.
    assert sorted(r.session_id for r in server.of("CloseSession")) == ["fork-1", "fork-2", "s-1"]
    server.listed = False
    _, out = run(address, "/sessions", model=MODEL)
    assert "the server lists no sessions of yours" in out


def test_fork_without_a_cache_opens_a_new_session(echo: tuple[str, EchoServer]) -> None:
    address, server = echo
    server.fork_fails = True
    code, out = run(address, "hi", "/fork", "more", model=MODEL)
    assert code == 0
    assert len(server.of("ForkSession")) == 1 and len(server.of("CreateSession")) == 2
    assert "now in session 2" in out
    # The new session gets the branch's whole history (it prefills it).
    assert sent(server)[-1] == ("s-1", ["hi", "echo: hi", "more"])
    # Nothing said yet: nothing to copy, no ForkSession at all.
    server.requests.clear()
    code, out = run(address, "/fork", "first", model=MODEL)
    assert code == 0 and not server.of("ForkSession") and len(server.of("CreateSession")) == 2
    assert sent(server) == [("s-1", ["first"])] and "now in session 2" in out


def test_export_then_import(echo: tuple[str, EchoServer], tmp_path: Path) -> None:
    address, server = echo
    path = tmp_path / "chat.hotloop"
    (tmp_path / "bad").write_bytes(chat_cli.EXPORT_MAGIC + b"{not json\n")
    (tmp_path / "raw").write_bytes(server.blob("raw"))
    (tmp_path / "foreign").write_bytes(b"something else")
    code, out = run(
        address,
        "hi",
        f"/export {path}",
        f"/import {path}",
        "more",
        "/export",
        f"/import {tmp_path / 'missing'}",
        f"/import {tmp_path / 'bad'}",
        f"/import {tmp_path / 'foreign'}",
        f"/import {tmp_path / 'raw'}",
        f"/export {tmp_path / 'no-such-dir' / 'x'}",
        model=MODEL,
        system="sys",
    )
    assert code == 0
    blob = server.blob("s-1")
    system, history, data = chat_cli.read_export(path.read_bytes())
    assert (system, [(m.role.value, m.content) for m in history], data) == (
        "sys",
        [("user", "hi"), ("assistant", "echo: hi")],
        blob,
    )
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"
    assert f"exported 2 messages and {len(blob)} bytes of cache to {path}" in out
    imports = server.of("ImportSession")
    assert imports[0].data == blob and imports[0].model == MODEL and imports[0].offset == 0
    assert "imported 2 messages, 321 tokens cached: now in session 2 (imported-1)" in out
    # The imported session continues the exported conversation (the cache covers it).
    assert sent(server)[-1] == ("imported-1", ["sys", "hi", "echo: hi", "more"])
    assert "usage: /export <file>" in out
    assert "cannot read" in out and "missing" in out
    assert "not a readable /export file" in out
    assert "INVALID_ARGUMENT: not an exported session" in out
    # A bare SDK export (no conversation) imports too: a session with an empty history.
    assert "imported 0 messages" in out
    assert "cannot write" in out
    assert len(imports) == 3


def test_read_export_of_other_bytes_is_a_bare_blob() -> None:
    assert chat_cli.read_export(b"\x00\x01") == (None, [], b"\x00\x01")
    with pytest.raises(ValueError, match="not a readable"):
        chat_cli.read_export(chat_cli.EXPORT_MAGIC + b'{"system": null, "history": [["robot", "x"]]}\n')
    with pytest.raises(ValueError, match="not a readable"):
        chat_cli.read_export(chat_cli.EXPORT_MAGIC + b"no newline")


def test_tool_calls_are_shown_and_answered_with_result(echo: tuple[str, EchoServer], tmp_path: Path) -> None:
    address, server = echo
    path = tmp_path / "tools.json"
    path.write_text('[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]')
    tools = chat_cli.load_tools(path.read_text())
    code, out = run(address, "find x", "/result", "/result 42", "/result again", "/history", "/tools", tools=tools)
    assert code == 0
    assert '→ lookup({"x": 1})  [call_7]' in out and "answer each call with /result <text>" in out
    assert "echo-1> echo: 42" in out  # with every call answered, the model's turn goes on
    assert "no tool call is waiting for a result" in out and "lookup: " in out
    first, second = server.of("Generate")
    assert [t.name for t in first.tools] == ["lookup"]
    assert [m.role for m in second.messages] == [common_pb2.ROLE_USER, common_pb2.ROLE_ASSISTANT, common_pb2.ROLE_TOOL]
    assert second.messages[1].tool_calls[0].arguments == '{"x": 1}' and second.messages[2].tool_call_id == "call_7"
    with pytest.raises(ValueError, match="not a tools file"):
        chat_cli.load_tools('{"name": "x"}')
