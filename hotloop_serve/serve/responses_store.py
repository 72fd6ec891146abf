"""Stored responses on their conversation's owner replica: the records, their sessions, the budgets.

A stored response is a node of a conversation tree: its conversation (engine messages, without
the instructions, which each request sends anew) up to and including its output, the engine
session whose cache holds that conversation, and what GET returns. Records share their
ancestors' message objects, so a chain of N responses costs N turns of text, not N^2.

Each engine session has a *head*: the response whose conversation its cache ends with.
Continuing the head extends the session in place (a hot follow-up); continuing any other
response (an older one, or one whose session moved on) forks (``Engine.fork_session``) so that
both branches stay hot. Budgets are per principal: a count and the bytes of the stored items;
past either a new stored response is refused (429) until the principal deletes some.
Nothing here touches the engine: the replica acts on what :meth:`ResponseStore.session_for`
says.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.errors import NotFound, ResourceExhausted
from hotloop_serve.serve.responses_schema import key_of


@dataclass(slots=True)
class StoredResponse:
    id: str
    principal: str
    messages: tuple[ChatMessage, ...]
    """The conversation through this response's output (no instructions)."""
    session: str
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    nbytes: int = field(default=0)


def size_of(body: dict[str, Any], input_items: list[dict[str, Any]]) -> int:
    """What a record counts against its principal's byte budget: its own items, as JSON."""
    return len(json.dumps(body["output"])) + len(json.dumps(input_items))


class ResponseStore:
    """The stored responses of one replica (see the module docstring)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._records: dict[str, StoredResponse] = {}
        self._count: defaultdict[str, int] = defaultdict(int)
        self._bytes: defaultdict[str, int] = defaultdict(int)
        self._heads: dict[str, str] = {}  # session id -> the response its cache ends with
        self._refs: defaultdict[str, int] = defaultdict(int)  # session id -> records using it

    def get(self, response_id: str, principal: str) -> StoredResponse:
        """The record, or NotFound: unknown, deleted, or another principal's (indistinguishable)."""
        rec = self._records.get(response_id)
        if rec is None or rec.principal != principal:
            shown = response_id if len(response_id) <= 80 else response_id[:77] + "..."
            raise NotFound(f"response {shown!r} not found")
        return rec

    def check_room(self, principal: str) -> None:
        """ResourceExhausted when one more stored response would exceed the principal's budget."""
        count, used = self._count[principal], self._bytes[principal]
        if count >= self.max_count or used >= self.max_bytes:
            raise ResourceExhausted(
                f"stored responses: this principal holds {count} responses ({used} bytes) on this replica, the "
                f"most allowed is {self.max_count} ({self.max_bytes} bytes; limits.responses_per_principal, "
                "limits.response_bytes_per_principal); delete some (DELETE /v1/responses/{id}) or send store: false",
                reason="RESPONSE_BUDGET",
            )

    def is_head(self, session: str, response_id: str) -> bool:
        return self._heads.get(session) == response_id

    def moved(self, session: str, response_id: str | None) -> None:
        """The session's cache now ends with ``response_id`` (None: with no stored response)."""
        if response_id is None:
            self._heads.pop(session, None)
        else:
            self._heads[session] = response_id

    def put(self, rec: StoredResponse) -> None:
        rec.nbytes = size_of(rec.body, rec.input_items)
        self._records[rec.id] = rec
        self._count[rec.principal] += 1
        self._bytes[rec.principal] += rec.nbytes
        self._heads[rec.session] = rec.id
        self._refs[rec.session] += 1

    def delete(self, response_id: str, principal: str) -> str | None:
        """Forget a record; returns its session when no other record uses it (close it then)."""
        rec = self.get(response_id, principal)
        del self._records[response_id]
        self._count[principal] -= 1
        self._bytes[principal] -= rec.nbytes
        if self._heads.get(rec.session) == response_id:
            del self._heads[rec.session]
        self._refs[rec.session] -= 1
        if self._refs[rec.session] > 0:
            return None
        del self._refs[rec.session]
        return rec.session

    def usage(self, principal: str) -> tuple[int, int]:
        return self._count[principal], self._bytes[principal]

    def records_of(self, key: str) -> list[StoredResponse]:
        """The records of conversation ``key``, of every principal."""
        return [r for r in self._records.values() if key_of(r.id) == key]

    def keys(self) -> set[str]:
        """The conversation keys of the records held (what a hand-over sends, one parcel each)."""
        return {key_of(rec_id) for rec_id in self._records}

    def take(self, key: str, principal: str | None) -> tuple[list[StoredResponse], dict[str, str]]:
        """Forget and return the records of conversation ``key`` (of ``principal``; None: of
        everyone), oldest first, and the heads of their sessions: what a peer adopts (:meth:`adopt`)."""
        records = [r for r in self.records_of(key) if principal in (None, r.principal)]
        sessions = {r.session for r in records}
        heads = {sid: head for sid, head in self._heads.items() if sid in sessions}
        for rec in records:
            self.delete(rec.id, rec.principal)
        return records, heads

    def adopt(self, records: list[StoredResponse], heads: dict[str, str]) -> None:
        """Hold records handed over by a peer (:meth:`take`), their sessions' heads as they were
        there; a record already held (loaded from a shared disk) stays as it is. They count
        against their principals' budgets here, which may exceed them: they are not new."""
        for rec in records:
            if rec.id not in self._records:
                self.put(rec)
        for sid in {r.session for r in records}:
            self.moved(sid, heads.get(sid))
