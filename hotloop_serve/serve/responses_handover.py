"""Stored responses follow their conversation between replicas, with the sessions they use.

A stored response lives on its conversation's owner (the replica its id's routing key hashes
to), with the engine session whose cache holds it. When the fleet changes, that owner changes:

- a replica that leaves (scale-in, a roll, a graceful stop) *pushes* every conversation's
  records to the key's next owner, one :class:`ResponseParcel` per conversation key, before the
  fleet's session hand-over (``fleet.ReplicaFleet.hand_over``): records are the only copy
  (without a shared ``persist_dir``), sessions only a cache;
- a replica asked for a response it does not hold (a new replica that now owns the key while
  the old owner still runs, or a push that reached another replica than the one the routers
  settled on) *pulls* it from every peer at once, as the fleet fetches a session.

Either way the parcel carries the sessions its records use, released on the giver (exported
and forgotten there), so that the continuation of a handed-over response is hot on its new
owner: a response's session may be a fork named after another routing key
(``<key>-<random>``), which the fleet's own session hand-over would send elsewhere. A parcel
that fails or times out costs a 404 for a push (the giver is gone) or nothing for a pull (the
giver keeps its records); caches are never wrong (blobs carry the model's fingerprint and are
bound to their principal).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hotloop_serve.engine.engine import Engine
from hotloop_serve.errors import HotloopError
from hotloop_serve.serve.responses_store import ResponseStore, StoredResponse

log = logging.getLogger("ray.serve")


@dataclass(slots=True)
class ResponseParcel:
    """One conversation's stored responses on their way to another replica (pickled by Ray)."""

    key: str
    records: list[StoredResponse]
    """Oldest first; they share their ancestors' messages, as they did on the giver."""
    heads: dict[str, str]
    """Session id -> the response its cache ends with (``ResponseStore.is_head``)."""
    sessions: list[tuple[str, str, bytes]] = field(default_factory=list)
    """(session id, principal, exported cache) of the sessions the records use."""


def pack(store: ResponseStore, engine: Engine, key: str, principal: str | None, busy: set[str]) -> ResponseParcel:
    """Take conversation ``key``'s records (``principal``'s; None: everyone's) out of ``store``,
    with their sessions released from ``engine`` (a busy one stays here: its reply is running;
    the new owner forks or rebuilds). Runs on a worker thread: exports copy KV state."""
    records, heads = store.take(key, principal)
    parcel = ResponseParcel(key, records, heads)
    owners = {rec.session: rec.principal for rec in records}
    for sid, owner in owners.items():
        if sid in busy or not engine.known(sid):
            continue
        try:
            blob = engine.release_session(sid, owner)
        except HotloopError as e:
            log.info("stored responses: could not release session %s: %s", sid[:12], e.message)
            continue
        if blob is not None:
            parcel.sessions.append((sid, owner, blob))
    return parcel


def unpack(store: ResponseStore, engine: Engine, parcel: ResponseParcel) -> list[str]:
    """Hold a parcel's records and adopt its sessions; the session ids adopted. A session
    refused (no room, a foreign blob) only means its next turn rebuilds it from the history.
    Runs on a worker thread."""
    adopted = []
    for sid, owner, blob in parcel.sessions:
        try:
            if engine.adopt_session(sid, owner, blob):
                adopted.append(sid)
        except HotloopError as e:
            log.info("stored responses: refused session %s: %s", sid[:12], e.message)
    store.adopt(parcel.records, parcel.heads)
    return adopted
