"""Commands to the scheduler thread: what other threads ask of KV memory, as typed values.

Session operations that touch KV memory (clear, close, fork, hand-over, export, import) must
run on the scheduler thread, which owns the llama.cpp context. The caller's thread queues one
of these and waits for its result (``Engine._call``); the thread runs them between steps
(``Engine._execute``). Values rather than closures (after TGI's queue commands): each says
what it does and what it returns, and the thread's whole repertoire is this module.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hotloop_serve.engine.session import KVBytes, Session

T = TypeVar("T")


class Command(Generic[T]):
    """A request to the scheduler thread whose result is a ``T``."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class ClearSession(Command[None]):
    """Empty the session's cache (its settings stay); a request holding it is cancelled."""

    session: Session


@dataclass(frozen=True, slots=True)
class CloseSession(Command[None]):
    """Forget the session; a request holding it is cancelled. ``keep_on_disk``: its cache is
    written to the disk tier instead of deleted from it (an idle timeout, not a client's close)."""

    session: Session
    keep_on_disk: bool = False


@dataclass(frozen=True, slots=True)
class ForkSession(Command[None]):
    """Start ``target`` with ``source``'s cache, whole or up to the common prefix with ``keep``."""

    source: Session
    target: Session
    keep: list[int] | None


@dataclass(frozen=True, slots=True)
class ReleaseSession(Command[tuple[list[int], "KVBytes | None"]]):
    """Hand the session over: its cache (a copy), and it is forgotten here; nothing when it is
    busy or holds no cache."""

    session: Session


@dataclass(frozen=True, slots=True)
class SnapshotSession(Command[tuple[list[int], "KVBytes | None"]]):
    """The session's cache as it would continue elsewhere (export)."""

    session: Session


@dataclass(frozen=True, slots=True)
class DropIfStale(Command[bool]):
    """Forget the session if it is idle and holds fewer than ``tokens`` tokens (a hand-over of a
    longer copy is arriving); True when it was forgotten."""

    session: Session
    tokens: int


@dataclass(frozen=True, slots=True)
class PlaceImport(Command[bool]):
    """Load an imported cache into the (new) session, hot; ``keep``: cut it to this prefix.
    False when llama.cpp refused the state."""

    session: Session
    tokens: list[int]
    kv: bytes
    keep: list[int] | None


@dataclass(frozen=True, slots=True)
class SnapshotAll(Command[None]):
    """Write every cached session to the disk tier (shutdown)."""


@dataclass(slots=True)
class Queued:
    """A command waiting for the scheduler thread, with the future its caller waits on."""

    command: Command[Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
