"""Stored responses on disk, under the engine's ``persist_dir``, so that they outlive their replica.

Sessions are kept on disk by the engine's disk tier; a stored response is kept next to them,
as one JSON file per response (``<persist_dir>/responses/<sha256 of the id>.json``: its
conversation, session, body and input items), written atomically (a temporary file renamed
into place). A replica that does not hold a response in memory (it restarted, or the
response's key moved to it with a fleet change and ``persist_dir`` is shared) loads it on
first use; its session is then the engine's to restore from disk, or the conversation
rebuilds it. A file that cannot be read is a miss (logged), never an error for the request.
Files are read and written off the event loop (``asyncio.to_thread``) by the caller.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.tools import ToolCall
from hotloop_serve.serve.responses_store import StoredResponse

log = logging.getLogger(__name__)


def _message_json(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [[c.id, c.name, c.arguments] for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"], out["name"] = m.tool_call_id, m.name
    return out


def _message_of(d: dict[str, Any]) -> ChatMessage:
    calls = tuple(ToolCall(*c) for c in d.get("tool_calls", ()))
    return ChatMessage(d["role"], d["content"], calls, d.get("tool_call_id", ""), d.get("name", ""))


class ResponseDisk:
    """One directory of stored responses (see the module docstring)."""

    def __init__(self, persist_dir: str) -> None:
        self.directory = Path(persist_dir) / "responses"

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{hashlib.sha256(response_id.encode()).hexdigest()}.json"

    def save(self, rec: StoredResponse) -> None:
        doc = {
            "id": rec.id,
            "principal": rec.principal,
            "messages": [_message_json(m) for m in rec.messages],
            "session": rec.session,
            "body": rec.body,
            "input_items": rec.input_items,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                os.replace(tmp, self._path(rec.id))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:  # the response is still served and held in memory
            log.warning("could not write stored response %s to %s: %s", rec.id, self.directory, e)

    def load(self, response_id: str, principal: str) -> StoredResponse | None:
        """The stored response if its file exists and is this principal's; else None."""
        path = self._path(response_id)
        try:
            doc = json.loads(path.read_text())
            if doc["id"] != response_id or doc["principal"] != principal:
                return None
            messages = tuple(_message_of(m) for m in doc["messages"])
            return StoredResponse(response_id, principal, messages, doc["session"], doc["body"], doc["input_items"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("unreadable stored response file %s (%s); ignored", path, e)
            return None

    def remove(self, response_id: str) -> None:
        try:
            self._path(response_id).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete stored response %s: %s", response_id, e)
