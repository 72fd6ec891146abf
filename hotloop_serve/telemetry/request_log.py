"""Structured request logs: one line per RPC, on the logger ``hotloop_serve.requests``.

``text`` writes logfmt (``key=value ...``), ``json`` one JSON object a line. The fields come from
a fixed list of identifiers, codes and numbers (method, status, duration, trace and span ids,
model, replica, session id, token counts, time to first token, finish reasons): message text,
prompts and replies are never among them, nor error details (which may quote a request).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

LOGGER = "hotloop_serve.requests"
Format = Literal["off", "text", "json"]

_HANDLER_NAME = "hotloop_serve.requests"


def configure_request_log(fmt: Format, stream: Any = None) -> logging.Logger:
    """Give the request logger its own stderr handler (idempotent: replaces the one it set before).

    The logger does not propagate: Ray's root handlers would add their own prefix to a JSON line.
    ``off`` leaves the logger disabled.
    """
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    logger.propagate = False
    if fmt == "off":
        logger.disabled = True
        return logger
    logger.disabled = False
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger


def _logfmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    text = str(value)
    if not text or any(c in text for c in ' "=\\'):
        return json.dumps(text)
    return text


def format_line(fmt: Format, fields: Mapping[str, Any], now: datetime | None = None) -> str:
    """The line for one RPC; fields whose value is None are left out."""
    stamp = (now or datetime.now(UTC)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    record = {"time": stamp, "level": "info", "logger": LOGGER, "msg": "rpc"}
    record.update({k: v for k, v in fields.items() if v is not None})
    if fmt == "json":
        return json.dumps(record, separators=(",", ":"))
    return " ".join(f"{k}={_logfmt_value(v)}" for k, v in record.items())


class RequestLog:
    """Writes the line of each finished RPC (format chosen once, at replica start)."""

    __slots__ = ("fmt", "logger")

    def __init__(self, fmt: Format = "off") -> None:
        self.fmt = fmt
        self.logger = logging.getLogger(LOGGER)

    @property
    def enabled(self) -> bool:
        return self.fmt != "off" and self.logger.isEnabledFor(logging.INFO)

    def write(self, fields: Mapping[str, Any]) -> None:
        if self.enabled:
            self.logger.info(format_line(self.fmt, fields))
