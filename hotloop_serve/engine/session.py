"""Sessions as the engine holds them, and the RAM store for evicted KV state.

A session is a cache of a conversation: the tokens whose keys/values sit in one llama.cpp
sequence (``hot``), or in host RAM after an eviction (``evicted``), or nowhere (``new`` /
``dropped``: rebuilt from the next request's history).
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from hotloop_serve.engine.settings import SamplingSettings

if TYPE_CHECKING:
    from hotloop_serve.engine.engine import Request


class SessionState:
    """One session inside one replica's engine."""

    __slots__ = ("closed", "id", "last_used", "owner", "request", "saved", "seq", "settings", "tokens")

    def __init__(self, session_id: str, owner: str, settings: SamplingSettings) -> None:
        self.id = session_id
        self.owner = owner
        self.settings = settings
        self.seq: int | None = None
        self.tokens: list[int] = []
        """Tokens held in the cache (hot or evicted), position i at index i."""
        self.saved: ctypes.Array[ctypes.c_uint8] | None = None
        self.request: Request | None = None
        self.last_used = time.monotonic()
        self.closed = False

    @property
    def state(self) -> str:
        if self.seq is not None:
            return "hot"
        if self.saved is not None:
            return "evicted"
        return "dropped" if self.tokens else "new"

    @property
    def context_tokens(self) -> int:
        return len(self.tokens) if (self.seq is not None or self.saved is not None) else 0


class EvictedStore:
    """LRU of evicted sessions' KV bytes within a byte budget; past it the oldest are dropped."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[str, SessionState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, session: SessionState, data: ctypes.Array[ctypes.c_uint8]) -> list[SessionState]:
        """Keep ``data`` for ``session``; return the sessions dropped to make room."""
        size = len(data)
        if size > self.budget:
            session.tokens = []
            return [session]
        session.saved = data
        self._lru[session.id] = session
        self.bytes += size
        dropped = []
        while self.bytes > self.budget:
            _, old = self._lru.popitem(last=False)
            self._forget_bytes(old)
            old.tokens = []
            dropped.append(old)
        return dropped

    def take(self, session: SessionState) -> ctypes.Array[ctypes.c_uint8] | None:
        """Remove and return a session's saved bytes (to restore it, or because it is gone)."""
        if self._lru.pop(session.id, None) is None:
            return None
        data = session.saved
        self._forget_bytes(session)
        return data

    def _forget_bytes(self, session: SessionState) -> None:
        if session.saved is not None:
            self.bytes -= len(session.saved)
            session.saved = None
