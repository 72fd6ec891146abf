"""Structured output: GBNF grammars and JSON Schemas, bounded before llama.cpp sees them.

A grammar is code that llama.cpp runs: its parser recurses once per nested group (32,000
nested parentheses overflow the stack and kill the process), its start builds every initial
parse stack (a ~500-byte grammar can ask for millions), and each sampled token checks every
live stack against the whole vocabulary. llama-cpp-python's JSON Schema converter turns
``maxLength: N`` into N nested groups, and recurses once per level of the schema. So nothing
a caller sends reaches either unchecked. Two layers:

1. **Static bounds** (:func:`check_schema`, :func:`check_gbnf`), cheap enough for any thread,
   the event loop included: sizes, nesting depth, rule counts, repetition counts, and no remote
   ``$ref``. Past a bound: INVALID_ARGUMENT naming it.
2. **A trial build** (:class:`GrammarProbe`) in a child process (``grammar_probe.py``) that
   holds the model's vocabulary: llama.cpp parses the grammar on a thread with a small stack,
   builds its sampler and samples a few steps over the whole vocabulary, within a time budget
   and a memory limit. A grammar that crashes it, runs past the budget or the memory limit is
   refused; the child is killed and started again, so no thread is left spinning and no lock
   is held in the replica. Only grammars that passed both layers reach the replica's own
   llama.cpp, which then does the same work again within the same bounds.

Results are cached by text (clients resend the same schema every turn): a turn pays for
neither layer after the first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from llama_cpp.llama_grammar import json_schema_to_gbnf

from hotloop_serve.bounded_json import loads as bounded_loads
from hotloop_serve.errors import InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

GBNF_DOCS = "https://github.com/ggml-org/llama.cpp/blob/master/grammars/README.md"

MAX_GRAMMAR_BYTES = 64 * 1024
"""Longest GBNF grammar or JSON Schema accepted (the text, before conversion)."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a JSON Schema's objects and arrays (a property of an array item of an
object is about 6 levels); the converter recurses a few frames per level."""
MAX_SCHEMA_NODES = 20_000
"""Most objects and arrays in one JSON Schema (bounds the converter's time)."""
MAX_REPETITION = 1000
"""Largest repetition count: ``minLength``/``maxLength``/``minItems``/``maxItems`` in a schema,
``{m,n}`` in a GBNF grammar or a schema's ``pattern``. The converter writes ``maxLength: N`` as
N nested groups; llama.cpp itself refuses ``{m,n}`` past 2,000."""
MAX_CONVERTED_BYTES = 1 << 20
"""Longest grammar the converter may write for one schema."""
MAX_GBNF_NESTING = MAX_REPETITION + 64
"""Deepest nesting of parenthesized groups in a grammar. llama.cpp's parser recurses once per
level; a converted ``maxLength`` of :data:`MAX_REPETITION` nests that deep, plus the schema's
own structure."""
MAX_GBNF_RULES = 4096
"""Most rules (``name ::= ...``) in one grammar."""

PROBE_BUDGET_S = 2.0
"""Time the trial build may take: parsing, the initial stacks, and :data:`PROBE_STEPS` sampled
tokens over the whole vocabulary (real schemas take milliseconds)."""
PROBE_STEPS = 8
PROBE_MEMORY_BYTES = 2 << 30
"""Address space the trial child may grow by beyond its start (llama.cpp's stacks of a hostile
grammar grow by gigabytes)."""
PROBE_QUEUE_S = 2 * PROBE_BUDGET_S
"""Longest a check waits for the trial child while it checks another grammar; past it,
RESOURCE_EXHAUSTED (retry): a flood of new grammars cannot hold requests without one."""

_REPETITION_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_GBNF_TOKENS = re.compile(
    r"""
      "(?:[^"\\]|\\.)*"           # a string literal (escapes consume the next character)
    | \[(?:[^\]\\]|\\.)*\]        # a character class
    | \#[^\r\n]*                  # a comment
    | <[^>]*>                     # a token: <[id]> or <text>
    | ::=                         # a rule definition
    | \{\s*\d*\s*(?:,\s*\d*\s*)?\}  # a repetition count
    | [()]
    """,
    re.VERBOSE | re.DOTALL,
)
_PROBE_SCRIPT = Path(__file__).with_name("grammar_probe.py")
_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)
_DIGITS = re.compile(r"\d+")


def _refuse(what: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{what} {message}", field=what)


def check_gbnf(grammar: str, what: str = "grammar") -> None:
    """Static bounds of a GBNF grammar: InvalidArgument naming the first one it breaks.

    The scan tokenizes as llama.cpp's parser does (string literals, character classes, tokens
    and comments hide their parentheses), so the nesting it counts is never less than what the
    parser will recurse through.
    """
    if "\0" in grammar:
        raise _refuse(what, "must not contain NUL characters")
    size = len(grammar.encode())
    if size > MAX_CONVERTED_BYTES:
        raise _refuse(what, f"is {size} bytes; at most {MAX_CONVERTED_BYTES} are accepted")
    if not _ROOT_RULE.search(grammar):
        raise _refuse(what, f"is not valid GBNF (it has no 'root' rule, the start symbol); see {GBNF_DOCS}")
    level = deepest = rules = 0
    for match in _GBNF_TOKENS.finditer(grammar):
        token = match.group()
        if token == "(":
            level += 1
            deepest = max(deepest, level)
        elif token == ")":
            level -= 1
        elif token == "::=":
            rules += 1
        elif token[0] == "{":
            counts = [int(d) for d in _DIGITS.findall(token)]
            if any(n > MAX_REPETITION for n in counts):
                raise _refuse(what, f"repeats an item {max(counts)} times ({token}); at most {MAX_REPETITION}")
    if deepest > MAX_GBNF_NESTING:
        raise _refuse(what, f"nests groups {deepest} deep; at most {MAX_GBNF_NESTING}")
    if rules > MAX_GBNF_RULES:
        raise _refuse(what, f"has {rules} rules; at most {MAX_GBNF_RULES}")


def _check_schema_bounds(schema: dict[str, Any]) -> None:
    """Repetition counts, patterns and references of a parsed schema, walked without recursion."""
    nodes = 0
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            children: Any = node
        elif isinstance(node, dict):
            children = node.values()
            for key in _REPETITION_KEYWORDS:
                value = node.get(key)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument(
                        f"json_schema: {key} must be a non-negative integer, got {value!r}", field="json_schema"
                    )
                if value > MAX_REPETITION:
                    raise InvalidArgument(
                        f"json_schema: {key} is {value}; at most {MAX_REPETITION} is accepted for structured output",
                        field="json_schema",
                    )
            ref = node.get("$ref")
            if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
                raise InvalidArgument(
                    f"json_schema: $ref {str(ref)[:80]!r} is not supported; only local references ('#/...') are",
                    field="json_schema",
                )
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                counts = [int(d) for d in _DIGITS.findall(" ".join(re.findall(r"\{[^}]*\}", pattern)))]
                if any(n > MAX_REPETITION for n in counts):
                    raise InvalidArgument(
                        f"json_schema: pattern repeats an item {max(counts)} times; at most {MAX_REPETITION}",
                        field="json_schema",
                    )
        else:
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise InvalidArgument(
                f"json_schema has more than {MAX_SCHEMA_NODES} objects and arrays", field="json_schema"
            )
        stack.extend(child for child in children if isinstance(child, (dict, list)))


def check_schema(schema: str) -> dict[str, Any]:
    """The parsed JSON Schema within its static bounds; InvalidArgument naming the first one broken."""
    parsed = bounded_loads(schema, "json_schema", max_depth=MAX_SCHEMA_DEPTH, field="json_schema")
    if not isinstance(parsed, dict):
        raise InvalidArgument(
            f"json_schema must be a JSON object (a schema), got {type(parsed).__name__}", field="json_schema"
        )
    _check_schema_bounds(parsed)
    return parsed


@functools.lru_cache(maxsize=256)
def schema_to_grammar(schema: str) -> str:
    """GBNF for a JSON Schema given as JSON text, within every bound; InvalidArgument otherwise."""
    parsed = check_schema(schema)
    try:
        grammar = str(json_schema_to_gbnf(json.dumps(parsed)))
    except RecursionError:
        raise InvalidArgument("json_schema is nested too deeply to convert", field="json_schema") from None
    except Exception as e:  # the converter asserts (or trips: KeyError, TypeError) on what it cannot convert
        detail = str(e) or type(e).__name__
        if len(detail) > 300:
            detail = detail[:297] + "..."
        raise InvalidArgument(f"json_schema is not supported: {detail}", field="json_schema") from e
    check_gbnf(grammar, "json_schema (as a grammar)")
    return grammar


@functools.lru_cache(maxsize=256)
def check_grammar(grammar: str) -> None:
    """Static bounds of a caller's GBNF grammar (see :func:`check_gbnf`), cached by its text."""
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise _refuse("grammar", f"must be at most {MAX_GRAMMAR_BYTES} bytes, got {size}")
    check_gbnf(grammar)


class GrammarProbe:
    """Trial builds of grammars in a child process that holds the model's vocabulary.

    One child per replica, started on the first grammar it has not seen and kept for the next;
    one check at a time. Verdicts are cached by the grammar's text, refusals included (a client
    resending a bad grammar gets its answer at once). Thread-safe; every call blocks its caller
    for at most :data:`PROBE_QUEUE_S` + :data:`PROBE_BUDGET_S`, so call it off the event loop.
    """

    def __init__(
        self,
        model_path: str | Path,
        budget_s: float = PROBE_BUDGET_S,
        steps: int = PROBE_STEPS,
        memory_bytes: int = PROBE_MEMORY_BYTES,
        cache_size: int = 512,
    ) -> None:
        self.model_path = str(model_path)
        self.budget_s = budget_s
        self.steps = steps
        self.memory_bytes = memory_bytes
        self._cache_size = cache_size
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()  # grammar -> refusal, or None: fine
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._started = 0
        self._ready = False
        self.counters = {"checks": 0, "refused": 0, "child_restarts": 0}

    def start(self) -> None:
        """Start the child now, in the background (it loads the vocabulary meanwhile), so that the
        first grammar a replica sees is not also the one that waits for that."""
        with self._lock:
            if self._child is None:
                self._spawn()

    def check(self, grammar: str, field: str = "grammar") -> None:
        """Return if llama.cpp builds and samples ``grammar`` within the bounds; InvalidArgument
        naming ``field`` (or RESOURCE_EXHAUSTED while the child is busy past :data:`PROBE_QUEUE_S`)
        otherwise."""
        verdict = self._cached(grammar)
        if verdict is ...:
            if not self._lock.acquire(timeout=PROBE_QUEUE_S):
                raise ResourceExhausted(
                    "the grammar checker is busy with other new grammars; retry shortly",
                    retry_after_s=PROBE_BUDGET_S,
                )
            try:
                verdict = self._cached(grammar)
                if verdict is ...:
                    verdict = self._trial(grammar)
                    self._remember(grammar, verdict)
            finally:
                self._lock.release()
        if verdict is not None:
            raise InvalidArgument(verdict if field == "grammar" else f"{field} (as a grammar): {verdict}", field=field)

    def _cached(self, grammar: str) -> Any:
        with contextlib.suppress(KeyError):
            verdict = self._verdicts[grammar]
            self._verdicts.move_to_end(grammar)
            return verdict
        return ...

    def _remember(self, grammar: str, verdict: str | None) -> None:
        self._verdicts[grammar] = verdict
        while len(self._verdicts) > self._cache_size:
            self._verdicts.popitem(last=False)

    def _trial(self, grammar: str) -> str | None:
        """One check in the child: None if it passed, else why not (the child replaced if needed)."""
        self.counters["checks"] += 1
        child = self._ready_child()
        assert child.stdin is not None and child.stdout is not None
        request = json.dumps({"grammar": grammar, "steps": self.steps}).encode() + b"\n"
        started = time.monotonic()
        try:
            child.stdin.write(request)
            child.stdin.flush()
            line = self._read_line(child, started + self.budget_s)
        except (BrokenPipeError, OSError):
            line = b""
        if not line:
            elapsed = time.monotonic() - started
            self._replace()
            self.counters["refused"] += 1
            if elapsed >= self.budget_s:
                return (
                    f"grammar is too costly for llama.cpp: building it and sampling {self.steps} tokens took "
                    f"longer than {self.budget_s:g} s (simplify it: fewer alternatives that can match nothing, "
                    "less nesting)"
                )
            return (
                "grammar is too complex for llama.cpp (its parser or sampler ran out of stack or memory); "
                "simplify it: less nesting, fewer or smaller repetitions"
            )
        answer = json.loads(line)
        if answer.get("ok"):
            return None
        self.counters["refused"] += 1
        return str(answer.get("error") or "grammar is not valid GBNF")

    def _read_line(self, child: subprocess.Popen[bytes], deadline: float) -> bytes:
        assert child.stdout is not None
        fd = child.stdout.fileno()
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return b""
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return b""
            piece = os.read(fd, 1 << 16)
            if not piece:
                return b""  # the child died
            buf += piece
        return buf

    def _spawn(self) -> None:
        """Start a child (it loads the vocabulary meanwhile: about 2 s for Gemma's 262,144 tokens)."""
        if self._started:
            self.counters["child_restarts"] += 1
        self._started += 1
        self._child = subprocess.Popen(
            # Run by path: as a module it would import the package, the engine with it (a second).
            [sys.executable, str(_PROBE_SCRIPT), self.model_path, str(self.memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._ready = False

    def _ready_child(self) -> subprocess.Popen[bytes]:
        """The child, started if need be, once it said it loaded the vocabulary (not counted in
        any check's budget)."""
        if self._child is None or self._child.poll() is not None:
            self._stop()
            self._spawn()
        assert self._child is not None
        if not self._ready:
            line = self._read_line(self._child, time.monotonic() + 60.0)
            if not line.startswith(b'{"ready"'):
                self._stop()
                raise ResourceExhausted("the grammar checker could not start; retry shortly", retry_after_s=5.0)
            self._ready = True
        return self._child

    def _replace(self) -> None:
        """Kill a child that failed a check and start the next one now, so the next check does
        not wait for it to load."""
        self._stop()
        self._spawn()

    def _stop(self) -> None:
        """Kill the child; it is reaped in the background (a child that grew by gigabytes takes
        a while to exit, and the caller is waiting for its answer)."""
        child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        threading.Thread(target=_reap, args=(child,), name="hotloop-grammar-reaper", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._stop()


def _reap(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=30.0)
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
