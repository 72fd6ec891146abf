"""``hotloop chat``: a streaming terminal chat on the Python SDK.

It is also the SDK's first user, so it only touches the public ``hotloop_client`` API:
the history lives here (as in hot-loop) and is sent whole each turn; the server's session
only keeps it hot. ``run_chat`` is the entry point other CLIs (``hotloop-serve start``)
call once their server is up; ``main`` is the ``hotloop`` console script.

With ``--tools FILE`` (a JSON list of function tools, OpenAI's shape) the model may call them:
each call is shown as it streams, and ``/result <text>`` answers the next unanswered call;
once every call has its result, the model's turn continues.

Input may be piped (``printf 'hi\\n/quit\\n' | hotloop``): lines are then read from stdin
and echoed, so a transcript reads like a session and tests can drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from hotloop_client import (
    Chunk,
    Client,
    HotloopError,
    Message,
    Model,
    NotFound,
    Role,
    Session,
    Settings,
    Tool,
    ToolCall,
    TurnInterrupted,
    Usage,
    assistant_message,
    with_message_replaced,
)
from rich.console import Console
from rich.table import Table

DEFAULT_ADDRESS = "localhost:9000"

HELP = """\
/system <text>         set the system prompt (clears the history, warms the prompt up)
/set <field> <value>   change a setting; value 'none' restores the server's default
/settings              show the session's settings
/clear                 clear the history and the server's cache
/context               tokens held in the session's KV cache
/history               the conversation, numbered (for /edit and /fork)
/regenerate            regenerate the last reply (the cache up to it is reused)
/edit <k> <text>       replace message k (see /history) and regenerate from there
/fork [k]              continue in a fork of this session (its cache copied on the server,
                       up to message k); the old one stays open: /switch
/switch [n]            list the chat's sessions, or continue in session n
/sessions              your sessions of this model on the server
/export <file>         save this session (its KV cache and the conversation) to a file
/import <file>         continue in a new session from an exported file (same model)
/tools                 the tools offered to the model (--tools FILE) and the tool choice
/tool_choice <c>       auto, none, required, or a tool's name
/result <text>         the result of the model's next unanswered tool call
/help                  this text
/quit                  leave (also Ctrl-D; Ctrl-C cancels a reply)"""

ReadLine = Callable[[], str]
"""Returns the next input line; raises EOFError (or KeyboardInterrupt) to end the chat."""


# --------------------------------------------------------------------------- /set values


def _parse_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def _parse_stop(value: str) -> tuple[str, ...]:
    """A JSON list (``["\\n\\n", "END"]``) or one literal string."""
    if value.startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(s, str) for s in parsed):
            raise ValueError("stop must be a JSON list of strings")
        return tuple(parsed)
    return (value,)


def _parser(hint: Any) -> Callable[[str], Any]:
    """How ``/set`` reads a value of a ``Settings`` field typed ``hint`` (``X | None``)."""
    kinds = set(typing.get_args(hint)) - {type(None)}
    if kinds == {bool}:
        return _parse_bool
    if kinds in ({int}, {float}, {str}):  # str: a grammar or JSON schema, taken verbatim
        return kinds.pop()  # type: ignore[no-any-return]
    if all(typing.get_origin(kind) is tuple for kind in kinds):
        return _parse_stop
    raise TypeError(f"no /set parser for a Settings field of type {hint}")


# One parser per ``Settings`` field (the SDK's mirror of ``hotloop.v1.Settings``, checked
# against its descriptor), in the proto's order: a new field needs no list edited here.
_HINTS = typing.get_type_hints(Settings)
_PARSERS: dict[str, Callable[[str], Any]] = {f.name: _parser(_HINTS[f.name]) for f in dataclasses.fields(Settings)}
_UNSET = {"none", "default", "random", "unset"}


def parse_setting(name: str, value: str) -> tuple[str, Any]:
    """``/set`` arguments as a ``Settings`` field and value (``None`` = server default).

    Raises ``ValueError`` with a message fit for the user.
    """
    field = name.strip().lower().replace("-", "_")
    if field not in _PARSERS:
        raise ValueError(f"unknown setting {name!r}; one of: {', '.join(_PARSERS)}")
    if value.strip().lower() in _UNSET:
        return field, None
    try:
        return field, _PARSERS[field](value.strip())
    except (ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"bad value for {field}: {exc}") from exc


def stats_line(usage: Usage | None, chunk: Chunk | None) -> str:
    """The dim line after each reply: what was generated, what the cache saved, how fast."""
    if usage is None:
        return ""
    parts = [
        f"{usage.completion_tokens} tokens",
        f"prompt {usage.prompt_tokens} ({usage.cached_tokens} cached)",
    ]
    timings = chunk.timings if chunk else None
    if timings is not None:
        # decode_ms spans first to last token: n tokens, n - 1 intervals.
        if usage.completion_tokens > 1 and timings.decode_ms > 0:
            parts.append(f"{(usage.completion_tokens - 1) / (timings.decode_ms / 1000):.1f} tok/s")
        parts.append(f"TTFT {timings.time_to_first_token_ms:.0f} ms")
    served_by = chunk.served_by if chunk else None
    if served_by is not None and served_by.replica:
        parts.append(f"replica {served_by.replica}{' (cache hit)' if served_by.cache_hit else ''}")
    return " · ".join(parts)


# --------------------------------------------------------------------------- /export files

EXPORT_MAGIC = b"HOTLOOP-CHAT 1\n"
"""First line of a file written by ``/export``: then one JSON line (model, system prompt,
history), then the session's exported blob (``Session.export()``) as is."""


def load_tools(data: str) -> list[Tool]:
    """``--tools``' file: a JSON list of function tools, as OpenAI's ``tools`` (``{"type":
    "function", "function": {...}}``) or flat (``{"name", "description", "parameters"}``)."""
    try:
        items = json.loads(data)
        if not isinstance(items, list):
            raise ValueError("the file must hold a JSON list of tools")
        tools = []
        for item in items:
            fn = item.get("function", item)
            tools.append(Tool(fn["name"], fn.get("description", ""), fn.get("parameters")))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a tools file: {exc}") from exc
    return tools


def call_line(call: ToolCall) -> str:
    return f"→ {call.name}({call.arguments})  [{call.id}]"


def write_export(path: Path, model: str, system: str | None, history: list[Message], blob: bytes) -> None:
    """Write ``/export``'s file atomically (a temporary file renamed over ``path``)."""
    header = {"model": model, "system": system, "history": [[m.role.value, m.content] for m in history]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(EXPORT_MAGIC)
            f.write(json.dumps(header, ensure_ascii=False).encode() + b"\n")
            f.write(blob)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_export(data: bytes) -> tuple[str | None, list[Message], bytes]:
    """``/export``'s file as (system prompt, history, blob); any other bytes are taken as a
    bare ``Session.export()`` blob with no conversation. Raises ``ValueError`` if damaged."""
    if not data.startswith(EXPORT_MAGIC):
        return None, [], data
    line, sep, blob = data[len(EXPORT_MAGIC) :].partition(b"\n")
    try:
        if not sep:
            raise ValueError("no header line")
        header = json.loads(line)
        system = header.get("system")
        history = [Message(Role(role), content) for role, content in header["history"]]
        if system is not None and not isinstance(system, str):
            raise ValueError("system must be a string")
        if not all(isinstance(m.content, str) for m in history):
            raise ValueError("message contents must be strings")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a readable /export file: {exc}") from exc
    return system, history, blob


def _ago(unix: float) -> str:
    if unix <= 0:
        return "never"
    seconds = max(0.0, time.time() - unix)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


# --------------------------------------------------------------------------- the chat loop


@dataclasses.dataclass
class Branch:
    """One conversation of the chat: its session (the server's cache), system prompt and history."""

    session: Session
    system: str | None
    history: list[Message]


class Chat:
    """The chat's conversations (one at first; /fork and /import add more), the current one's
    history and session, and the commands."""

    def __init__(
        self, session: Session, console: Console, system: str | None = None, model: Model | None = None
    ) -> None:
        self.console = console
        self.model = model
        self.branches = [Branch(session, system, [])]
        self.current = 0
        self.tools: list[Tool] = []
        self.tool_choice = ""

    # The current branch's parts, under the names the chat always used.
    @property
    def session(self) -> Session:
        return self.branches[self.current].session

    @session.setter
    def session(self, value: Session) -> None:
        self.branches[self.current].session = value

    @property
    def system(self) -> str | None:
        return self.branches[self.current].system

    @system.setter
    def system(self, value: str | None) -> None:
        self.branches[self.current].system = value

    @property
    def history(self) -> list[Message]:
        return self.branches[self.current].history

    @history.setter
    def history(self, value: list[Message]) -> None:
        self.branches[self.current].history = value

    def sessions(self) -> list[Session]:
        """Every session the chat opened (to close them when it ends)."""
        return [b.session for b in self.branches]

    # -- conversation -----------------------------------------------------------------

    def warm_system(self) -> None:
        """Prefill the system prompt so the first turn only computes the user's message."""
        if not self.system:
            return
        usage = self.session.warmup([Message(Role.SYSTEM, self.system)])
        self.console.print(f"system prompt warmed up ({usage.prompt_tokens} tokens)", style="dim")

    def turn(self, text: str) -> None:
        """Send one user message and stream the reply; the history grows only on success."""
        self.reply_to([*self.history, Message(Role.USER, text)])

    def reply_to(self, history: list[Message]) -> bool:
        """Stream the reply to ``history`` (which ends with a user message); on success it,
        plus the reply, becomes the conversation. Rewinding (/regenerate, /edit) is this with a
        shorter or edited history: the server reuses its cache up to the first difference."""
        system = [Message(Role.SYSTEM, self.system)] if self.system else []
        for attempt in (1, 2):
            try:
                reply, last = self._stream([*system, *history])
            except KeyboardInterrupt:
                self.console.print("\n[cancelled]", style="dim", markup=False)
                return False
            except TurnInterrupted as exc:
                if attempt == 2:
                    self.show_error(exc, mid_line=True)
                    return False
                # The session is a cache: the same history rebuilds it on a live replica.
                self.console.print("\n[replica lost mid-reply; retrying the turn]", style="yellow", markup=False)
                continue
            except HotloopError as exc:
                self.show_error(exc, mid_line=True)
                return False
            self.history = [*history, reply]
            if reply.tool_calls:
                self.console.print("answer each call with /result <text>", style="dim", markup=False)
            line = stats_line(last.usage if last else None, last)
            if line:
                self.console.print(line, style="dim", markup=False, highlight=False)
            return True
        return False  # unreachable: the second attempt returns

    def _stream(self, messages: list[Message]) -> tuple[Message, Chunk | None]:
        """Stream a reply: its text as it comes, then each call it made; (the reply, its last chunk)."""
        chunks: list[Chunk] = []
        self.console.print(f"{self.session.model}> ", style="bold green", end="", markup=False)
        generate = self.session.generate(messages, tools=self.tools, tool_choice=self.tool_choice)
        # closing(): a Ctrl-C anywhere in the loop cancels the RPC at once.
        with contextlib.closing(generate) as stream:
            for chunk in stream:
                chunks.append(chunk)
                if chunk.text:
                    self.console.print(chunk.text, end="", markup=False, highlight=False, soft_wrap=True)
        self.console.print()
        reply = assistant_message(chunks)
        for call in reply.tool_calls:
            self.console.print(call_line(call), style="magenta", markup=False, highlight=False)
        return reply, chunks[-1] if chunks else None

    def unanswered_calls(self) -> list[ToolCall]:
        """The last reply's calls that have no result yet (in the order the model made them)."""
        answered: set[str] = set()
        for m in reversed(self.history):
            if m.role == Role.TOOL:
                answered.add(m.tool_call_id)
            elif m.role == Role.ASSISTANT:
                return [c for c in m.tool_calls if c.id not in answered]
            else:
                return []
        return []

    def show_error(self, exc: HotloopError, *, mid_line: bool = False) -> None:
        prefix = "\n" if mid_line else ""
        self.console.print(f"{prefix}error: {exc}", style="bold red", markup=False, highlight=False)

    # -- commands ---------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave the chat."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        name = name.lower()
        try:
            if name in {"quit", "exit", "q"}:
                return False
            if name == "help":
                self.console.print(HELP, markup=False, highlight=False)
            elif name == "system":
                self._cmd_system(arg)
            elif name == "set":
                self._cmd_set(arg)
            elif name == "settings":
                self._cmd_settings()
            elif name == "clear":
                self.history.clear()
                self.session.clear_cache()
                self.console.print("history and cache cleared", style="dim")
                self.warm_system()
            elif name == "context":
                self.console.print(f"{self.session.context()} tokens in the session's cache")
            elif name == "history":
                self._cmd_history()
            elif name == "regenerate":
                self._cmd_regenerate()
            elif name == "edit":
                self._cmd_edit(arg)
            elif name == "fork":
                self._cmd_fork(arg)
            elif name == "switch":
                self._cmd_switch(arg)
            elif name == "sessions":
                self._cmd_sessions()
            elif name == "export":
                self._cmd_export(arg)
            elif name == "import":
                self._cmd_import(arg)
            elif name == "tools":
                self._cmd_tools()
            elif name == "tool_choice":
                self._cmd_tool_choice(arg)
            elif name == "result":
                self._cmd_result(arg)
            else:
                self.console.print(f"unknown command /{name}; /help lists them", style="yellow", markup=False)
        except HotloopError as exc:
            self.show_error(exc)
        return True

    def _cmd_tools(self) -> None:
        if not self.tools:
            self.console.print("no tools (start the chat with --tools FILE)", markup=False)
            return
        for t in self.tools:
            self.console.print(f"{t.name}: {t.description}", markup=False, highlight=False)
        self.console.print(f"tool choice: {self.tool_choice or 'auto'}", style="dim", markup=False)

    def _cmd_tool_choice(self, arg: str) -> None:
        if arg not in ("auto", "none", "required") and arg not in {t.name for t in self.tools}:
            self._usage("/tool_choice auto|none|required|<tool name>")
            return
        self.tool_choice = arg
        self.console.print(f"tool choice: {arg}", style="dim", markup=False)

    def _cmd_result(self, text: str) -> None:
        """Answer the next unanswered call; with all of them answered, the model goes on."""
        if not text:
            self._usage("/result <text>")
            return
        pending = self.unanswered_calls()
        if not pending:
            self.console.print("no tool call is waiting for a result", style="yellow", markup=False)
            return
        self.history = [*self.history, Message(Role.TOOL, text, tool_call_id=pending[0].id)]
        if len(pending) > 1:
            self.console.print(f"{len(pending) - 1} more call(s) to answer", style="dim", markup=False)
            return
        self.reply_to(self.history)

    def _cmd_system(self, text: str) -> None:
        if not text:
            self.console.print(f"system prompt: {self.system!r}" if self.system else "no system prompt", markup=False)
            return
        self.system = text
        self.history.clear()
        self.console.print("system prompt set; history cleared", style="dim")
        self.warm_system()

    def _cmd_set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not name or not value.strip():
            self.console.print("usage: /set <field> <value>   e.g. /set temperature 0.2", style="yellow")
            return
        try:
            field, parsed = parse_setting(name, value)
        except ValueError as exc:
            self.console.print(str(exc), style="yellow", markup=False)
            return
        settings = self.session.set_settings(dataclasses.replace(self.session.settings, **{field: parsed}))
        shown = getattr(settings, field)
        self.console.print(f"{field} = {'default' if shown is None else shown!r}", style="dim", markup=False)

    def _cmd_settings(self) -> None:
        table = Table(show_header=False, box=None, pad_edge=False)
        for field in dataclasses.fields(Settings):
            value = getattr(self.session.settings, field.name)
            table.add_row(field.name, "(server default)" if value is None else repr(value))
        self.console.print(table)

    def _usage(self, text: str) -> None:
        self.console.print(f"usage: {text}", style="yellow", markup=False)

    def _message_number(self, arg: str) -> int | None:
        """``arg`` as a message number of /history (1-based), or None after telling the user."""
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if not 1 <= k <= len(self.history):
            self.console.print(
                f"no message {arg!r}: /history numbers them 1 to {len(self.history)}", style="yellow", markup=False
            )
            return None
        return k

    def _cmd_history(self) -> None:
        if self.system:
            self.console.print(f"   system: {self.system}", markup=False, highlight=False)
        if not self.history:
            self.console.print("(no messages yet)", style="dim")
        for k, message in enumerate(self.history, 1):
            self.console.print(f"{k:>3} {message.role.value}: {message.content}", markup=False, highlight=False)
            for call in message.tool_calls:
                self.console.print(f"      {call_line(call)}", markup=False, highlight=False)

    def _cmd_regenerate(self) -> None:
        if not self.history or self.history[-1].role != Role.ASSISTANT:
            self.console.print("no reply to regenerate yet", style="yellow")
            return
        self.reply_to(self.history[:-1])

    def _cmd_edit(self, arg: str) -> None:
        number, _, text = arg.partition(" ")
        text = text.strip()
        if not number or not text:
            self._usage("/edit <k> <text>   (k: a message number of /history)")
            return
        k = self._message_number(number)
        if k is None:
            return
        edited = with_message_replaced(self.history, k - 1, text)
        if edited[-1].role == Role.ASSISTANT:
            # An edited reply is taken as written; the next turn continues from it.
            self.history = edited
            self.console.print(f"reply {k} replaced; the messages after it are dropped", style="dim", markup=False)
            return
        self.reply_to(edited)

    def _switch_to(self, branch: Branch, what: str) -> None:
        self.branches.append(branch)
        self.current = len(self.branches) - 1
        self.console.print(
            f"{what}: now in session {self.current + 1} ({branch.session.id}); /switch lists them",
            style="dim",
            markup=False,
        )

    def _cmd_fork(self, arg: str) -> None:
        history = list(self.history)
        if arg:
            k = self._message_number(arg)
            if k is None:
                return
            history = history[:k]
        # The cache of the conversation the fork starts with, named explicitly (also when it is
        # all of it): the server copies those tokens in KV memory, no prefill again.
        keep = [*([Message(Role.SYSTEM, self.system)] if self.system else []), *history]
        forked: Session | None = None
        try:
            forked = self.session.fork(keep) if keep else None
        except NotFound:
            if self.model is None:
                raise
        if forked is None:
            if self.model is None:
                self.console.print("nothing to fork yet: say something first", style="yellow")
                return
            # Nothing cached to copy (nothing said yet, never used, or expired): a new session
            # with the same settings; the fork's next turn prefills its history.
            forked = self.model.new_session(settings=self.session.settings)
        self._switch_to(Branch(forked, self.system, history), f"forked session {self.current + 1}")

    def _cmd_switch(self, arg: str) -> None:
        if not arg:
            for n, branch in enumerate(self.branches, 1):
                mark = "*" if n == self.current + 1 else " "
                self.console.print(
                    f"{mark} {n}  {branch.session.id}  {len(branch.history)} messages", markup=False, highlight=False
                )
            return
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if not 1 <= n <= len(self.branches):
            self.console.print(
                f"no session {arg!r}: /switch lists 1 to {len(self.branches)}", style="yellow", markup=False
            )
            return
        self.current = n - 1
        self.console.print(
            f"now in session {n} ({self.session.id}, {len(self.history)} messages)", style="dim", markup=False
        )

    def _cmd_sessions(self) -> None:
        if self.model is None:
            self.console.print("/sessions needs the model (not available here)", style="yellow")
            return
        mine = {b.session.id: n for n, b in enumerate(self.branches, 1)}
        table = Table(box=None, pad_edge=False)
        for column in ("", "id", "state", "tokens", "last used", "replica"):
            table.add_column(column)
        listed = self.model.list_sessions()
        if not listed:
            # Listing is per principal; each anonymous session is its own tenant, listed to no one.
            self.console.print(
                "the server lists no sessions of yours (without auth, anonymous callers are shown none)", style="dim"
            )
            return
        for info in listed:
            n = mine.get(info.id)
            mark = "" if n is None else ("*" if n == self.current + 1 else str(n))
            replica = info.served_by.replica if info.served_by else ""
            table.add_row(mark, info.id, info.state, str(info.context_tokens), _ago(info.last_used), replica)
        self.console.print(table)

    def _cmd_export(self, arg: str) -> None:
        if not arg:
            self._usage("/export <file>")
            return
        blob = self.session.export()
        path = Path(arg).expanduser()
        try:
            write_export(path, self.session.model, self.system, self.history, blob)
        except OSError as exc:
            self.console.print(f"cannot write {path}: {exc}", style="bold red", markup=False)
            return
        self.console.print(
            f"exported {len(self.history)} messages and {len(blob)} bytes of cache to {path}", style="dim", markup=False
        )

    def _cmd_import(self, arg: str) -> None:
        if not arg:
            self._usage("/import <file>")
            return
        if self.model is None:
            self.console.print("/import needs the model (not available here)", style="yellow")
            return
        path = Path(arg).expanduser()
        try:
            system, history, blob = read_export(path.read_bytes())
        except (OSError, ValueError) as exc:
            self.console.print(f"cannot read {path}: {exc}", style="bold red", markup=False)
            return
        imported = self.model.import_session(blob)  # with the exported session's settings
        tokens = imported.context()
        self._switch_to(Branch(imported, system, history), f"imported {len(history)} messages, {tokens} tokens cached")

    # -- main loop --------------------------------------------------------------------

    def run(self, read_line: ReadLine) -> None:
        """Read lines until /quit, EOF or Ctrl-C at the prompt."""
        while True:
            try:
                line = read_line().strip()
            except (EOFError, KeyboardInterrupt):
                self.console.print()
                return
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.turn(line)


def _stdin_reader(console: Console) -> ReadLine:
    """Interactive prompt on a TTY; plain lines (echoed) when stdin is piped."""
    if sys.stdin.isatty():
        return lambda: console.input("[bold cyan]you>[/] ")

    def read() -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        line = line.rstrip("\r\n")
        console.print(f"you> {line}", markup=False, highlight=False)
        return line

    return read


def run_chat(
    address: str = DEFAULT_ADDRESS,
    model: str | None = None,
    *,
    token: str | None = None,
    tls: bool = False,
    root_certificates: bytes | None = None,
    system: str | None = None,
    settings: Settings | None = None,
    console: Console | None = None,
    read_line: ReadLine | None = None,
    tools: list[Tool] | None = None,
) -> int:
    """Chat with ``model`` (default: the server's first) at ``address``; returns an exit code.

    ``read_line`` and ``console`` default to the terminal; pass them to embed or test.
    """
    console = console or Console(highlight=False)
    read_line = read_line or _stdin_reader(console)
    with Client(address, token=token, tls=tls, root_certificates=root_certificates) as client:
        try:
            if model is None:
                models = client.list_models()
                if not models:
                    console.print(f"no models are served at {address}", style="bold red", markup=False)
                    return 1
                model = models[0].name
            session = client.model(model).new_session(settings=settings)
        except HotloopError as exc:
            console.print(f"cannot start a chat at {address}: {exc}", style="bold red", markup=False)
            return 1
        chat = Chat(session, console, system, model=client.model(model))
        chat.tools = list(tools or ())
        try:
            console.print(f"chatting with {model} at {address}; /help for commands", style="dim", markup=False)
            try:
                chat.warm_system()
            except HotloopError as exc:
                chat.show_error(exc)
            chat.run(read_line)
        finally:
            for opened in chat.sessions():
                with contextlib.suppress(HotloopError):  # leaving anyway; the server expires it
                    opened.close(timeout=5)
    return 0


# --------------------------------------------------------------------------- console script

app = typer.Typer(add_completion=False, help="Streaming terminal chat with a hotloop-serve model.")


@app.command()
def chat(
    *,
    address: Annotated[str, typer.Option(help="host:port of the server's gRPC proxy")] = DEFAULT_ADDRESS,
    model: Annotated[str | None, typer.Option(help="model to chat with (default: the first served)")] = None,
    token: Annotated[str | None, typer.Option(envvar="HOTLOOP_TOKEN", help="bearer token")] = None,
    tls: Annotated[bool, typer.Option(help="connect with TLS")] = False,
    root_certificates: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="PEM file of CAs to trust (implies --tls)")
    ] = None,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    temperature: Annotated[float | None, typer.Option(help="sampling temperature (0 = greedy)")] = None,
    seed: Annotated[int | None, typer.Option(help="fixed seed for reproducible replies")] = None,
    sample_len: Annotated[int | None, typer.Option(help="maximum tokens per reply")] = None,
    tools: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="JSON file of function tools the model may call"),
    ] = None,
) -> None:
    """Chat with a served model; the reply streams as it is generated."""
    settings = Settings(temperature=temperature, seed=seed, sample_len=sample_len)
    try:
        offered = load_tools(tools.read_text()) if tools else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tools") from exc
    code = run_chat(
        address,
        model,
        token=token,
        tls=tls,
        root_certificates=root_certificates.read_bytes() if root_certificates else None,
        system=system,
        settings=settings,
        tools=offered,
    )
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    """The ``hotloop`` console script: ``hotloop [chat] [OPTIONS]``.

    ``chat`` is accepted as a first word so ``hotloop chat`` (the documented spelling) and a
    bare ``hotloop`` both work, leaving room for more subcommands later.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["chat"]:
        args = args[1:]
    typer.main.get_command(app).main(args=args, prog_name="hotloop chat")


if __name__ == "__main__":
    main()
