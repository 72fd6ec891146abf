"""Rendering a conversation into the model's prompt text with its chat template.

The template comes, in order, from the config (an override), the GGUF's
``tokenizer.chat_template``, or a built-in fallback chosen by architecture: the bundled
Gemma base model carries no template, yet must still chat in Gemma's turn format.
Templates are Jinja, rendered in a sandbox as Hugging Face does.

A conversation with tools (definitions, calls, results) is rendered by the template itself when
it renders tools, else lowered to plain messages in its family's syntax (``tools.py``); a
template of no known family refuses tools rather than render them as silent text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotloop_serve.engine.tools import ToolCall, ToolFormat, ToolSpec, detect_format, native_messages
from hotloop_serve.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")

# Architecture prefix -> built-in template; the first match wins, chatml is the last resort.
_FALLBACKS = (("gemma", "gemma"), ("llama", "llama3"))


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation, as the engine sees it."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's calls (its ``content`` is the text before them, often empty)."""
    tool_call_id: str = ""
    """A ``tool`` message: the call whose result it is."""
    name: str = ""
    """A ``tool`` message: the function called."""


def builtin_template(architecture: str) -> tuple[str, str]:
    """(name, source) of the built-in template for an architecture."""
    name = next((t for prefix, t in _FALLBACKS if architecture.startswith(prefix)), "chatml")
    return name, files("hotloop_serve.engine").joinpath(f"templates/{name}.jinja").read_text()


def _raise(message: str) -> NoReturn:
    raise InvalidArgument(f"chat template: {message}")


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise InvalidArgument(f"chat template from {origin} does not compile: {e}") from e
        self.origin = origin
        self.source = source
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.tool_format: ToolFormat | None = detect_format(source, origin)
        """How this template's model writes tool calls; None: tools are refused."""

    def render(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[ToolSpec] = ()
    ) -> str:
        """The prompt text for a conversation (with ``tools`` offered to the model); roles are
        validated before rendering."""
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidArgument(f"message {i}: unknown role {m.role!r}; use one of {', '.join(ROLES)}")
        extra: dict[str, Any] = {}
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            fmt = self.tool_format
            if fmt is None:
                raise InvalidArgument(
                    f"tools: the chat template from {self.origin} has no tool-calling syntax this server knows "
                    "(built in: gemma, hermes/chatml, llama3; or a template rendering tools in one of them)",
                    field="tools",
                )
            if fmt.native:
                data = native_messages(messages)
                if tools:
                    extra["tools"] = [t.openai_json() for t in tools]
            else:
                data = fmt.lower(messages, tools)
        else:
            data = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(
                messages=data, add_generation_prompt=add_generation_prompt, **self._tokens, **extra
            )
        except InvalidArgument:
            raise
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"chat template from {self.origin} failed on this history: {e}") from e
