"""What one caller may hold on a replica: sessions, and bytes of imports still arriving.

The engine bounds sessions per principal (``limits.sessions_per_principal``), but anonymous
callers are not one principal there: each anonymous session is its own tenant, so that no
cache is shared between strangers (``ModelServicer._tenant``). Without a bound of their own,
one anonymous caller forking in a loop filled the replica to ``engine.max_sessions`` and every
other caller got RESOURCE_EXHAUSTED. Here anonymous callers are counted by their address.

An import arrives in parts (``ImportSession`` with offsets) and is held in memory until its
last part; 512 unfinished 1 MiB imports were all held. :class:`PendingImports` bounds those
bytes per caller and per replica, and forgets an import whose next part does not come in time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hotloop_serve.errors import InvalidArgument, ResourceExhausted
from hotloop_serve.serve.auth import ANONYMOUS

IMPORT_TTL_S = 120.0
"""An import whose next part does not come within this time is forgotten."""


def peer_host(peer: str | None) -> str:
    """The address part of a gRPC peer (``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``)."""
    if not peer:
        return "in-process"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def caller_key(principal: str, peer: str | None) -> str:
    """Whose quota a call counts against: its principal, or for anonymous callers their address."""
    return f"{ANONYMOUS}@{peer_host(peer)}" if principal == ANONYMOUS else principal


class AnonymousSessions:
    """Sessions created by anonymous callers, counted per address (principals with a token are
    counted by the engine). Forgotten sessions (closed, expired) are pruned when counting."""

    def __init__(self, per_caller: int, known: Callable[[str], bool]) -> None:
        self.per_caller = per_caller
        self._known = known
        self._by_caller: dict[str, OrderedDict[str, None]] = {}

    def admit(self, caller: str) -> None:
        """RESOURCE_EXHAUSTED if ``caller`` (a :func:`caller_key`) may create no more sessions here."""
        if not caller.startswith(f"{ANONYMOUS}@"):
            return
        mine = self._by_caller.get(caller)
        if not mine:
            return
        for sid in [sid for sid in mine if not self._known(sid)]:
            del mine[sid]
        if len(mine) >= self.per_caller:
            raise ResourceExhausted(
                f"anonymous callers from {caller.partition('@')[2]} already hold {len(mine)} sessions on this replica "
                f"(limits.sessions_per_principal={self.per_caller}); close some, or authenticate with a token"
            )

    def add(self, caller: str, sid: str) -> None:
        if caller.startswith(f"{ANONYMOUS}@"):
            self._by_caller.setdefault(caller, OrderedDict())[sid] = None


@dataclass
class _Import:
    caller: str
    buf: bytearray = field(default_factory=bytearray)
    touched: float = field(default_factory=time.monotonic)


class PendingImports:
    """The parts of imports received so far, bounded in bytes per caller and per replica."""

    def __init__(
        self,
        per_caller: int,
        per_replica: int,
        ttl_s: float = IMPORT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_caller = per_caller
        self.per_replica = per_replica
        self.ttl_s = ttl_s
        self._clock = clock
        self._imports: dict[tuple[str, str], _Import] = {}

    def held(self, caller: str | None = None) -> int:
        """Bytes held (for one caller, or for all)."""
        return sum(len(i.buf) for i in self._imports.values() if caller is None or i.caller == caller)

    def _expire(self) -> None:
        now = self._clock()
        for slot in [s for s, i in self._imports.items() if now - i.touched > self.ttl_s]:
            del self._imports[slot]

    def add(self, slot: tuple[str, str], caller: str, offset: int, data: bytes, total: int) -> bytes | None:
        """Take one part; the whole blob once its last part arrived, else None.

        A part sent again (a retry after a failover whose first attempt arrived) is taken as
        received. Out-of-order parts, parts past ``total`` and parts past a bound are refused,
        and a refused import is forgotten.
        """
        self._expire()
        pending = self._imports.get(slot)
        if pending is None or offset == 0:
            pending = _Import(caller)
        end = offset + len(data)
        if 0 < end <= len(pending.buf) and pending.buf[offset:end] == data:
            pending.touched = self._clock()
            return None
        if offset != len(pending.buf):
            self._imports.pop(slot, None)
            raise InvalidArgument(
                f"import part at offset {offset}, expected {len(pending.buf)}: send the parts in order from 0"
            )
        if end > total:
            self._imports.pop(slot, None)
            raise InvalidArgument(f"import parts exceed total_bytes={total}")
        if end < total:
            others = self._imports.get(slot)
            held_caller = self.held(caller) - (len(others.buf) if others is not None and others.caller == caller else 0)
            held_all = self.held() - (len(others.buf) if others is not None else 0)
            if held_caller + end > self.per_caller:
                self._imports.pop(slot, None)
                raise ResourceExhausted(
                    f"unfinished imports of this caller would hold {held_caller + end} bytes on this replica; at most "
                    f"{self.per_caller} (limits.import_bytes_per_principal): finish the others first, or let them "
                    f"expire ({self.ttl_s:g} s after their last part)",
                    retry_after_s=self.ttl_s,
                )
            if held_all + end > self.per_replica:
                self._imports.pop(slot, None)
                raise ResourceExhausted(
                    f"this replica holds {held_all} bytes of unfinished imports (at most {self.per_replica}: "
                    "limits.import_bytes_per_replica); retry later",
                    retry_after_s=5.0,
                )
        pending.buf += data
        pending.touched = self._clock()
        if end < total:
            self._imports[slot] = pending
            return None
        self._imports.pop(slot, None)
        return bytes(pending.buf)
