"""JSON from callers, parsed with a bound on its nesting.

Python's ``json`` parser and everything that walks the result afterwards (pydantic, the JSON
Schema converter, ``json.dumps``) recurse once per level of nesting. A document nested
100,000 levels deep is a few hundred kilobytes, and without a bound it reaches a caller as a
``RecursionError`` (an INTERNAL error, a 500) or, in a recursive C++ parser further on, as a
crashed process. Every JSON text that arrives from outside (request bodies, headers, session
exports, schemas) goes through :func:`loads` here, which answers INVALID_ARGUMENT naming the
bound instead.
"""

from __future__ import annotations

import json
from typing import Any

from hotloop_serve.errors import InvalidArgument

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a request body or header: ample for any chat request
(a JSON Schema inside one has its own, lower bound: ``engine/grammar.py``)."""


def depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), counted without recursion and
    stopping as soon as it passes ``limit`` (the value returned is then ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        level += 1
        if level > limit:
            return limit + 1
        deepest = max(deepest, level)
        stack.extend((child, level) for child in children if isinstance(child, (dict, list)))
    return deepest


def loads(data: str | bytes, what: str, max_depth: int = MAX_DEPTH, field: str | None = None) -> Any:
    """Parse ``data``; InvalidArgument naming ``what`` when it is not JSON or nests past ``max_depth``."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise InvalidArgument(f"{what} nests deeper than {max_depth} levels", field=field) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}", field=field) from None
    if depth(value, max_depth) > max_depth:
        raise InvalidArgument(f"{what} nests deeper than {max_depth} levels", field=field)
    return value
