"""Tool calling as the engine sees it: definitions, calls, and each model family's call syntax.

A model calls a tool by writing text in the syntax it was trained on. Three families are built
in, each a :class:`ToolFormat` (docs/openai.md shows them):

- ``gemma``: Gemma has no tool syntax of its own (Google's guide prompts for fenced blocks), so a
  call is a fenced ``tool_call`` block holding ``{"name": ..., "arguments": {...}}`` and results
  come back in fenced ``tool_output`` blocks in a user turn;
- ``hermes``: ChatML models (Qwen 2.5+, Hermes, most fine-tunes): ``<tool_call>`` tags around
  the same JSON, results in ``<tool_response>`` tags in a user turn;
- ``llama3``: Llama 3.1+'s JSON tool calling, ``{"name": ..., "parameters": {...}}``, results in
  an ``ipython`` turn.

A chat template that renders tools itself (it reads ``tools`` and ``tool_calls``: Qwen's,
Llama 3.1's) is ``native``: it gets the definitions, calls and results as Hugging Face passes
them, and only the reply is parsed with the family's syntax. Any other template of a known
family gets the conversation *lowered* to plain messages (definitions in the system prompt,
calls as the assistant's text, results as the format's turn), which it renders as usual.

Every call's text starts with its format's ``trigger``, and its text is what the grammar of
``tool_grammar.py`` forces after the trigger, so rendering a call back reproduces what the
model generated: a tool loop's next turn extends the session's cache instead of diverging.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hotloop_serve import bounded_json
from hotloop_serve.errors import InvalidArgument

if TYPE_CHECKING:
    from hotloop_serve.engine.chat_template import ChatMessage

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for function names; it also keeps names literal in grammars and prompts."""
_SENTINEL = "\0ARGS\0"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call. ``parameters`` is its JSON Schema as JSON text (hashable)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'

    def openai_json(self) -> dict[str, Any]:
        """The definition as OpenAI (and Hugging Face chat templates) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: ``arguments`` is JSON text, exactly as generated."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether and what the model must call: ``auto`` (text or calls), ``none`` (text only),
    ``required`` (calls only; with ``name``, calls of that function only)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def calls(self) -> bool:
        """Whether a reply may hold calls (so the reply is constrained and parsed)."""
        return self.mode != "none"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's syntax for definitions, calls and results (see the module docstring)."""

    name: str
    trigger: str
    """The text every call starts with; free text never contains it when calls are allowed."""
    open: str
    """Text before a call's JSON object (starts with ``trigger``, or is empty when the JSON is
    the trigger's start)."""
    close: str
    args_key: str
    separator: str
    """Between two calls of one reply."""
    result_role: str
    result_open: str
    result_close: str
    preamble: str
    """Introduces the definitions in the system prompt; ``{tools}`` is replaced by them."""
    native: bool = False
    """The chat template renders tools itself (only the reply is parsed with this syntax)."""

    def call_text(self, name: str, arguments: str) -> str:
        return f'{self.open}{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}{self.close}'

    def call_parts(self, name: str) -> tuple[str, str]:
        """(text before the arguments, text after them) of a call of ``name``."""
        head, tail = self.call_text(name, _SENTINEL).split(_SENTINEL)
        return head, tail

    def tools_text(self, tools: Sequence[ToolSpec]) -> str:
        listing = "\n".join(json.dumps(t.openai_json(), ensure_ascii=False) for t in tools)
        return self.preamble.replace("{tools}", listing)

    def lower(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
        """The conversation as plain messages any template of the family renders: the definitions
        appended to the system prompt, calls as the assistant's text, consecutive tool results
        as one turn of ``result_role``."""
        out: list[dict[str, Any]] = []
        if tools:
            listing = self.tools_text(tools)
            if messages and messages[0].role == "system":
                out.append({"role": "system", "content": f"{messages[0].content.rstrip()}\n\n{listing}"})
                messages = messages[1:]
            else:
                out.append({"role": "system", "content": listing})
        for m in messages:
            if m.role == "tool":
                result = f"{self.result_open}{m.content}{self.result_close}"
                if out and out[-1].get("_results"):
                    out[-1]["content"] += "\n" + result
                else:
                    out.append({"role": self.result_role, "content": result, "_results": True})
            elif m.role == "assistant" and m.tool_calls:
                calls = self.separator.join(self.call_text(c.name, c.arguments) for c in m.tool_calls)
                text = m.content
                if text and not text[-1].isspace():
                    text += "\n"
                out.append({"role": "assistant", "content": text + calls})
            else:
                out.append({"role": m.role, "content": m.content})
        for d in out:
            d.pop("_results", None)
        return out


def native_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as Hugging Face passes it to templates that render tools (arguments as
    objects, as those templates expect)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _loads_or_text(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            d["name"] = m.name
        out.append(d)
    return out


def _loads_or_text(arguments: str) -> Any:
    """A call's arguments as JSON for the template, else as the text they are (a caller's history
    may carry anything; nesting is bounded so a template never recurses without end)."""
    try:
        return bounded_json.loads(arguments, "tool call arguments")
    except InvalidArgument:
        return arguments


GEMMA = ToolFormat(
    name="gemma",
    trigger="```tool_call",
    open="```tool_call\n",
    close="\n```",
    args_key="arguments",
    separator="\n",
    result_role="user",
    result_open="```tool_output\n",
    result_close="\n```",
    preamble=(
        "You can call functions. To call one, reply with only a block like this one:\n"
        '```tool_call\n{"name": "function_name", "arguments": {"argument": "value"}}\n```\n'
        "Each result comes back in a ```tool_output block.\nThe functions:\n{tools}"
    ),
)
HERMES = ToolFormat(
    name="hermes",
    trigger="<tool_call>",
    open="<tool_call>\n",
    close="\n</tool_call>",
    args_key="arguments",
    separator="\n",
    result_role="user",
    result_open="<tool_response>\n",
    result_close="\n</tool_response>",
    preamble=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
)
LLAMA3 = ToolFormat(
    name="llama3",
    trigger='{"name"',
    open="",
    close="",
    args_key="parameters",
    separator="\n",
    result_role="ipython",
    result_open="",
    result_close="",
    preamble=(
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        "value}. Do not use variables.\n\n{tools}"
    ),
)
BUILTIN_FORMATS = {"gemma": GEMMA, "chatml": HERMES, "llama3": LLAMA3}
"""Built-in chat templates (``templates/*.jinja``) -> their tool syntax."""
_RENDERS_TOOLS = re.compile(r"\btools\b")


def detect_format(source: str, origin: str) -> ToolFormat | None:
    """The tool syntax of a chat template, or None when this server knows none for it.

    Built-in templates map by name. A template that renders tools itself is native, and its
    call syntax is recognised by its markers; any other template is recognised by its turn
    markers (Gemma's, Llama 3's headers, ChatML's) and gets the family's lowering.
    """
    if origin.startswith("builtin:"):
        return BUILTIN_FORMATS.get(origin.removeprefix("builtin:"))
    if _RENDERS_TOOLS.search(source) and "tool_call" in source:
        if "<tool_call>" in source:
            return replace(HERMES, native=True)
        if "<|start_header_id|>" in source:
            return replace(LLAMA3, native=True)
        return None
    if "<start_of_turn>" in source:
        return GEMMA
    if "<|start_header_id|>" in source:
        return LLAMA3
    if "<|im_start|>" in source:
        return HERMES
    return None
