"""Splitting a reply, as it streams, into its text and its tool calls (one ``ToolFormat``'s syntax).

The grammar (``tool_grammar.py``) already guarantees the shape, so this is a small state
machine, linear in the reply: free text until the trigger (holding back a tail that could be
the trigger's start, so no call syntax ever leaks into the text), the call's head up to its
arguments (which names the function), the arguments (one JSON object, followed by a scanner of
strings and nesting so they stream as they come), the call's tail, then the next call or the
end. A reply cut short (``max_tokens``, a stop sequence) leaves its last call incomplete;
anything that is not the expected syntax (no grammar enforced it) becomes text from there on.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hotloop_serve.engine.tools import ToolCall, ToolFormat

_TEXT, _HEAD, _ARGS, _TAIL, _BETWEEN, _DEAD = range(6)


def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18)


@dataclass(slots=True)
class CallDelta:
    """A piece of call ``index``: its id and name come with its first piece only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    """What one piece of the reply adds: text, and pieces of calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolCallParser:
    """Feed the reply's text piece by piece; each piece gives its :class:`Parsed` part."""

    def __init__(self, fmt: ToolFormat, names: Sequence[str], new_id: Callable[[], str] = new_call_id) -> None:
        self._fmt = fmt
        self._heads = {name: fmt.call_parts(name) for name in names}
        self._next = fmt.separator + fmt.trigger
        self._new_id = new_id
        self._state = _TEXT
        self._buf = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._tail = ""
        self.calls: list[ToolCall] = []
        """The calls so far (a call's arguments grow as they stream)."""
        self._complete = 0

    @property
    def complete(self) -> bool:
        """Whether the reply held calls and every call ended."""
        return bool(self.calls) and self._complete == len(self.calls)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The end of the reply: text held back is text after all (a call cut short stays cut).

        A reply cut by a limit right after a call's trigger, before the call's name was whole,
        ends neither as text (the call syntax must never leak into ``content``) nor as a call
        (it has no name): it is dropped.
        """
        out = Parsed()
        if self._state in (_TEXT, _DEAD):
            out.content = self._buf
        self._buf = ""
        return out

    # -- one transition; False: wait for more text ------------------------------------------
    def _step(self, out: Parsed) -> bool:
        state, buf = self._state, self._buf
        if state == _DEAD:
            out.content += buf
            self._buf = ""
            return False
        if state == _TEXT:
            trigger = self._fmt.trigger
            at = buf.find(trigger)
            if at >= 0:
                out.content += buf[:at]
                self._buf, self._state = buf[at:], _HEAD
                return True
            keep = _held(buf, trigger)
            out.content += buf[: len(buf) - keep]
            self._buf = buf[len(buf) - keep :]
            return False
        if state == _HEAD:
            for name, (head, tail) in self._heads.items():
                if buf.startswith(head):
                    call = ToolCall(self._new_id(), name, "")
                    self.calls.append(call)
                    out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, name))
                    self._buf, self._state, self._tail = buf[len(head) :], _ARGS, tail
                    self._depth, self._in_string, self._escaped = 0, False, False
                    return True
            if any(head.startswith(buf) for head, _ in self._heads.values()):
                return False
            self._state = _DEAD
            return True
        if state == _ARGS:
            end = self._scan(buf)
            self._add_arguments(out, buf if end is None else buf[:end])
            if end is None:
                self._buf = ""
                return False
            self._buf, self._state = buf[end:], _TAIL
            return True
        if state == _TAIL:
            blank = len(buf) - len(buf.lstrip())
            if blank:  # whitespace the schema's grammar allows after the object: the arguments' own
                self._add_arguments(out, buf[:blank])
                self._buf = buf = buf[blank:]
                if not buf:
                    return False
            if buf.startswith(self._tail):
                self._complete += 1
                self._buf, self._state = buf[len(self._tail) :], _BETWEEN
                return True
            if self._tail.startswith(buf):
                return False
            self._state = _DEAD
            return True
        # _BETWEEN: the next call, or (as the grammar allows nothing else) the end
        if buf.startswith(self._next):
            self._buf, self._state = buf[len(self._fmt.separator) :], _HEAD
            return True
        if self._next.startswith(buf):
            return False
        self._state = _DEAD
        return True

    def _add_arguments(self, out: Parsed, piece: str) -> None:
        if piece:
            index = len(self.calls) - 1
            last = self.calls[index]
            self.calls[index] = ToolCall(last.id, last.name, last.arguments + piece)
            out.calls.append(CallDelta(index, piece))

    def _scan(self, text: str) -> int | None:
        """Where the arguments' JSON object ends in ``text`` (continuing the scan), or None."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None


def _held(text: str, trigger: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``trigger``."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0
