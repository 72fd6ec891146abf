"""Rendering a conversation into the model's prompt text with its chat template.

The template comes, in order, from the config (an override), the GGUF's
``tokenizer.chat_template``, or a built-in fallback chosen by architecture: the bundled
Gemma base model carries no template, yet must still chat in Gemma's turn format.
Templates are Jinja, rendered in a sandbox as Hugging Face does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.resources import files
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hotloop_serve.errors import InvalidArgument

ROLES = ("system", "user", "assistant")

# Architecture prefix -> built-in template; the first match wins, chatml is the last resort.
_FALLBACKS = (("gemma", "gemma"), ("llama", "llama3"))


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation, as the engine sees it."""

    role: str
    content: str


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

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation; roles are validated before rendering."""
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidArgument(f"message {i}: unknown role {m.role!r}; use one of {', '.join(ROLES)}")
        data: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(messages=data, add_generation_prompt=add_generation_prompt, **self._tokens)
        except InvalidArgument:
            raise
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"chat template from {self.origin} failed on this history: {e}") from e
