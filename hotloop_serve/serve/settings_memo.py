"""Settings a replica keeps for sessions another replica owns: its stand-in's memory.

A stock gRPC client sets a session's settings once (CreateSession, UpdateSettings) and then
sends turns without them. Those settings live with the session on its owner; if the owner dies
hard (node lost, OOM kill) there is no hand-over, and the replica that takes the session's
turns next (the runner-up under the rendezvous ranking) would serve them with the server's
defaults. So the owner also sends each change to the runner-up, which keeps it here, bounded
in bytes, least recently set first out. A session the runner-up then meets without a cache
starts from these settings, and a replacement of the dead owner gets them from the runner-up
along with the session (see ``fleet.ReplicaFleet.give_session``).
"""

from __future__ import annotations

from collections import OrderedDict

from hotloop_serve.engine.settings import SamplingSettings

DEFAULT_BUDGET_BYTES = 32 * 1024 * 1024
_ENTRY_OVERHEAD = 256
"""Bytes counted per entry besides its strings (ids, numbers, the dict's own slots)."""


def _size(sid: str, principal: str, settings: SamplingSettings) -> int:
    text = len(settings.grammar) + len(settings.json_schema) + sum(len(s) for s in settings.stop)
    return _ENTRY_OVERHEAD + len(sid) + len(principal) + text


class SettingsMemo:
    """Session id -> (principal, settings), least recently set evicted past ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[str, SamplingSettings, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, sid: str, principal: str, settings: SamplingSettings | None) -> None:
        """Remember ``settings`` for the session, or forget it (None: the session was closed)."""
        old = self._entries.pop(sid, None)
        if old is not None:
            self.bytes -= old[2]
        if settings is None:
            return
        size = _size(sid, principal, settings)
        self._entries[sid] = (principal, settings, size)
        self.bytes += size
        while self.bytes > self.budget_bytes and self._entries:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def get(self, sid: str, principal: str) -> SamplingSettings | None:
        """The settings remembered for the session, if the caller is the principal that set them."""
        entry = self._entries.get(sid)
        if entry is None or entry[0] != principal:
            return None
        return entry[1]
