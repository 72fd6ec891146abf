"""Sessions as one replica's engine holds them, their registry, and the RAM store of evicted KV.

A session is a cache of a conversation. Its :class:`SessionPhase` says where that cache is:
in one llama.cpp sequence (``HOT``), in host RAM after an eviction (``EVICTED``), nowhere
because it was never built (``NEW``) or was lost (``DROPPED``: evicted past the RAM budget, a
failed restore, sliding-window cells reused) -- the next request's history rebuilds it --
or gone for good (``CLOSED``). Only the KV manager (``kv.py``) moves a session between
phases; the registry here only creates and forgets entries.
"""

from __future__ import annotations

import ctypes
import enum
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import NotFound, ResourceExhausted

if TYPE_CHECKING:
    from hotloop_serve.engine.requests import Request

KVBytes = ctypes.Array[ctypes.c_uint8]


class SessionPhase(enum.Enum):
    NEW = "new"
    HOT = "hot"
    EVICTED = "evicted"
    DROPPED = "dropped"
    CLOSED = "closed"


class Session:
    """One session inside one replica's engine."""

    __slots__ = (
        "disk",
        "finished_at",
        "id",
        "kept_turns",
        "last_used",
        "owner",
        "pending",
        "phase",
        "request",
        "return_s",
        "saved",
        "seq",
        "settings",
        "tokens",
        "window_floor",
    )

    def __init__(self, session_id: str, owner: str, settings: SamplingSettings) -> None:
        self.id = session_id
        self.owner = owner
        self.settings = settings
        self.phase = SessionPhase.NEW
        self.seq: int | None = None
        self.tokens: list[int] = []
        """Tokens held in the cache (hot or evicted), position i at index i."""
        self.window_floor = 0
        """Lowest position whose sliding-window cells the cache still holds: above 0 after a
        restore (llama.cpp restores only the window of the last position), so the cache cannot
        be cut below ``window_floor + n_swa`` without a rebuild."""
        self.saved: KVBytes | None = None
        self.request: Request | None = None
        """The request holding the session (admitted, running or pre-empted)."""
        self.disk = False
        """A copy of its cache may be on disk (persistence): clearing or closing deletes it."""
        self.pending = 0
        """Requests the scheduler holds for it but has not admitted yet: the TTL never forgets a
        session one of them needs. Written and read on the scheduler thread only (requests still
        in the engine's inbox are checked there, under the engine's lock)."""
        self.last_used = time.monotonic()
        self.finished_at = 0.0
        """When its last reply ended (``perf_counter``; 0 once its next request came)."""
        self.return_s: float | None = None
        """How long its client took to send the next request after the previous reply ended
        (None: not seen yet): the engine holds a step for the next turn only of quick clients."""
        self.kept_turns = 0
        """Turns in a row admitted into a slot kept for it while others waited (the scheduler's
        starvation bound, ``KEPT_TURNS_MAX``)."""

    @property
    def closed(self) -> bool:
        return self.phase is SessionPhase.CLOSED

    @property
    def context_tokens(self) -> int:
        return len(self.tokens) if self.phase in (SessionPhase.HOT, SessionPhase.EVICTED) else 0

    @property
    def busy(self) -> bool:
        return self.request is not None or self.pending > 0


class EvictedStore:
    """LRU of evicted sessions' KV bytes within a byte budget.

    Pinned entries (pre-empted running requests) count against the bytes but are never the
    ones dropped: a running reply must resume, an idle cache can be rebuilt.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[str, Session] = OrderedDict()
        self._pinned: set[str] = set()

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, session: Session, data: KVBytes, pinned: bool = False) -> list[tuple[Session, KVBytes]]:
        """Keep ``data`` for ``session``; return the idle sessions dropped to make room, with their bytes."""
        if not pinned and len(data) > self.budget:
            return [(session, data)]
        session.saved = data
        self._lru[session.id] = session
        if pinned:
            self._pinned.add(session.id)
        self.bytes += len(data)
        dropped: list[tuple[Session, KVBytes]] = []
        for sid in list(self._lru):
            if self.bytes <= self.budget:
                break
            if sid in self._pinned:
                continue
            old = self._lru.pop(sid)
            old_data = old.saved
            self._forget_bytes(old)
            if old_data is not None:
                dropped.append((old, old_data))
        return dropped

    def unpin(self, session: Session) -> None:
        self._pinned.discard(session.id)

    def take(self, session: Session) -> KVBytes | None:
        """Remove and return a session's saved bytes (to restore it, or because it is gone)."""
        if self._lru.pop(session.id, None) is None:
            return None
        self._pinned.discard(session.id)
        data = session.saved
        self._forget_bytes(session)
        return data

    def _forget_bytes(self, session: Session) -> None:
        if session.saved is not None:
            self.bytes -= len(session.saved)
            session.saved = None


class SessionRegistry:
    """The sessions a replica knows, with their quotas. Callers hold the engine's lock."""

    def __init__(self, max_sessions: int, per_owner: int | None) -> None:
        self.max_sessions = max_sessions
        self.per_owner = per_owner
        self._sessions: dict[str, Session] = {}
        self._per_owner: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def owned(self, session_id: str, owner: str) -> Session:
        """The caller's session, or NotFound (another principal's session does not exist for them)."""
        s = self._sessions.get(session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id} not found")
        return s

    def get_or_create(self, session_id: str, owner: str, settings: SamplingSettings) -> tuple[Session, bool]:
        s = self._sessions.get(session_id)
        if s is not None:
            if s.owner != owner:
                raise NotFound(f"session {session_id} not found")
            return s, False
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"this replica holds its maximum of {self.max_sessions} sessions "
                f"(engine.max_sessions); close sessions you no longer use"
            )
        mine = self._per_owner.get(owner, 0)
        if self.per_owner is not None and mine >= self.per_owner:
            raise ResourceExhausted(
                f"principal {owner!r} already has {mine} sessions on this replica "
                f"(limits.sessions_per_principal={self.per_owner}); close some first"
            )
        s = self._sessions[session_id] = Session(session_id, owner, settings)
        self._per_owner[owner] = mine + 1
        return s, True

    def remove(self, s: Session) -> None:
        if self._sessions.get(s.id) is s:
            del self._sessions[s.id]
            left = self._per_owner.get(s.owner, 1) - 1
            if left:
                self._per_owner[s.owner] = left
            else:
                self._per_owner.pop(s.owner, None)

    def idle_past(self, ttl_s: float, now: float) -> list[Session]:
        """Sessions untouched for ``ttl_s`` with no request running or waiting for them."""
        return [s for s in self._sessions.values() if not s.busy and now - s.last_used > ttl_s]

    def values(self) -> list[Session]:
        return list(self._sessions.values())
