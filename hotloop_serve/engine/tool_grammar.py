"""GBNF grammars that make a reply's tool calls parse and match their tools' parameter schemas.

Each tool's parameter schema goes through the same converter as ``json_schema`` structured
output (``grammar.schema_to_grammar``); its rules are renamed apart (``t0-``, ``t1-``...) and
joined under one call rule that spells the format's envelope literally (``tools.ToolFormat``:
the model only chooses the function and the arguments).

- ``required`` (or a named function): the reply is the calls, nothing else.
- ``auto`` with a response format (a JSON Schema for the answer): the reply is that JSON, or the
  calls. The format never starts with a trigger of ours except llama3's ``{"name"``, which then
  reads as a call (the grammar still makes it one).
- ``auto``: the reply is free text, or text and then calls. A small model cannot be trusted to
  finish a call it starts, so the text part is a grammar of its own: any text that does not
  contain the format's trigger (a KMP automaton over the trigger, one rule per matched prefix).
  The moment the model writes the trigger, the rest of the call is forced: the same effect as
  llama.cpp's lazy grammars with trigger words, in a plain grammar the sampler already takes.

After the calls the grammar is complete, so the sampler allows only end-of-generation: a reply
with calls ends with them. At most ``MAX_PARALLEL_CALLS`` calls, one without parallel calls.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hotloop_serve.engine.grammar import schema_to_grammar
from hotloop_serve.engine.tools import ToolChoice, ToolFormat, ToolSpec

MAX_PARALLEL_CALLS = 8
_WORD = re.compile(r"[A-Za-z0-9_-]+")


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _class_char(ch: str) -> str:
    """One character inside a GBNF character class, escaped when it could mean anything else."""
    if ch.isascii() and ch.isalnum():
        return ch
    code = ord(ch)
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}"


def rename_rules(gbnf: str, prefix: str) -> str:
    """Every rule name of ``gbnf`` (definitions and references) prefixed, so that several
    converted schemas live in one grammar. String literals, character classes, repetition
    counts and comments are left as they are."""
    out: list[str] = []
    i, n = 0, len(gbnf)
    while i < n:
        ch = gbnf[i]
        if ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i : j + 1])
            i = j + 1
        elif ch == "{":
            j = gbnf.find("}", i)
            j = n - 1 if j < 0 else j
            out.append(gbnf[i : j + 1])
            i = j + 1
        elif ch == "#":
            j = gbnf.find("\n", i)
            j = n if j < 0 else j
            out.append(gbnf[i:j])
            i = j
        else:
            m = _WORD.match(gbnf, i)
            if m is None:
                out.append(ch)
                i += 1
            else:
                out.append(prefix + m.group())
                i = m.end()
    return "".join(out)


def avoiding(trigger: str, then: str, prefix: str = "text") -> list[str]:
    """Rules ``{prefix}-0``...: any text without ``trigger`` (it may end anywhere), and on the
    trigger's last character, rule ``then``. Knuth-Morris-Pratt: state i = characters of the
    trigger matched so far; a mismatch falls back to the longest border, as in KMP's table."""
    m = len(trigger)
    fail = [0] * m
    k = 0
    for i in range(1, m):
        while k and trigger[i] != trigger[k]:
            k = fail[k - 1]
        if trigger[i] == trigger[k]:
            k += 1
        fail[i] = k

    def step(state: int, ch: str) -> int:
        while True:
            if trigger[state] == ch:
                return state + 1
            if state == 0:
                return 0
            state = fail[state - 1]

    alphabet = sorted(set(trigger))
    rules = []
    for state in range(m):
        # Every character that falls back to state 0 goes into one negated class: few alternatives
        # per state keep the sampler's parse stacks few (it checks each against the vocabulary).
        onward = {ch: step(state, ch) for ch in alphabet if step(state, ch) != 0}
        alts = ["[^" + "".join(_class_char(c) for c in sorted(onward)) + f"] {prefix}-0"]
        for ch, nxt in sorted(onward.items()):
            alts.append(f"{literal(ch)} {then if nxt == m else f'{prefix}-{nxt}'}")
        rules.append(f"{prefix}-{state} ::= | {' | '.join(alts)}")  # empty first: "| " at a line's end continues it
    return rules


def tool_grammar(
    fmt: ToolFormat, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool, answer: str | None = None
) -> str | None:
    """The GBNF a reply must match, or None when it is free (``tool_choice: none``); ``answer``,
    a GBNF, constrains a reply without calls (``auto`` only: ``required`` replies are calls).
    InvalidArgument (from the converter) names a parameter schema it cannot take; callers
    add which tool it was (``schema_to_grammar`` errors are cached per schema)."""
    if not choice.calls or not tools:
        return None
    candidates = [(i, t) for i, t in enumerate(tools) if choice.name is None or t.name == choice.name]
    rules: list[str] = []
    alts: list[str] = []
    for i, tool in candidates:
        head, tail = fmt.call_parts(tool.name)
        rules.append(rename_rules(schema_to_grammar(tool.parameters), f"t{i}-"))
        alts.append(f"{literal(head[len(fmt.trigger) :])} t{i}-root {literal(tail)}")
    rules.append(f"call ::= {' | '.join(alts)}")
    more = f" ({literal(fmt.separator + fmt.trigger)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    rules.append(f"calls ::= call{more}")
    if choice.mode == "required":
        rules.append(f"root ::= {literal(fmt.trigger)} calls")
    elif answer is not None:
        rules.append(rename_rules(answer, "answer-"))
        rules.append(f"root ::= answer-root | {literal(fmt.trigger)} calls")
    else:
        rules.append("root ::= text-0")
        rules.extend(avoiding(fmt.trigger, "calls"))
    return "\n".join(rules) + "\n"
