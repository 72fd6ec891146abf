"""Structured output: GBNF grammars checked once, JSON Schemas converted with llama-cpp-python's converter.

Both are cached by their text (clients resend the same schema every turn), so a turn pays
for neither after the first. Errors are :class:`InvalidArgument` naming the problem.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import threading

import llama_cpp as ll
from llama_cpp.llama_grammar import json_schema_to_gbnf

from hotloop_serve.errors import InvalidArgument

GBNF_DOCS = "https://github.com/ggml-org/llama.cpp/blob/master/grammars/README.md"
_CAPTURE = threading.Lock()
_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)


@functools.lru_cache(maxsize=256)
def schema_to_grammar(schema: str) -> str:
    """GBNF for a JSON Schema given as JSON text; InvalidArgument naming what the converter refused."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"json_schema is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"json_schema must be a JSON object (a schema), got {type(parsed).__name__}")
    try:
        return str(json_schema_to_gbnf(json.dumps(parsed)))
    except RecursionError as e:
        raise InvalidArgument("json_schema is nested too deeply to convert") from e
    except Exception as e:  # the converter asserts (or trips: KeyError, TypeError) on what it cannot convert
        detail = str(e) or type(e).__name__
        if len(detail) > 300:
            detail = detail[:297] + "..."
        raise InvalidArgument(f"json_schema is not supported: {detail}") from e


@functools.lru_cache(maxsize=256)
def check_grammar(grammar: str) -> None:
    """Parse ``grammar`` with llama.cpp's own parser (no model needed); InvalidArgument with its complaint."""
    if "\0" in grammar:
        raise InvalidArgument("grammar must not contain NUL characters")
    if not _ROOT_RULE.search(grammar):
        raise InvalidArgument(f"grammar is not valid GBNF (it has no 'root' rule, the start symbol); see {GBNF_DOCS}")
    log = io.StringIO()
    with _CAPTURE, contextlib.redirect_stderr(log):
        sampler = ll.llama_sampler_init_grammar(None, grammar.encode(), b"root")
    if sampler:
        ll.llama_sampler_free(sampler)
        return
    # llama.cpp says why through its log callback, which llama-cpp-python may have silenced.
    said = " ".join(log.getvalue().split()) or "llama.cpp's parser refused it"
    raise InvalidArgument(f"grammar is not valid GBNF ({said}); see {GBNF_DOCS}")
