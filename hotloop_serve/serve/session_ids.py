"""Session ids that any replica can check: ``<routing key>.<signature>``.

The routing key (client-chosen or generated) is what the affinity router hashes; the
signature binds it to the model and the principal that created it, with a key shared by
all replicas of the app. So a session rebuilt on another replica after a failover still
belongs to its creator, and another principal's request with the same id is NOT_FOUND,
without any replica-to-replica state.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

from hotloop_serve.errors import InvalidArgument, NotFound

KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{8,64}")
"""A routing key, matched whole (``fullmatch``: ``$`` would accept a trailing newline)."""


def routing_key(session_id: str) -> str:
    """The part of an id the router hashes (the whole string when it has no signature)."""
    return session_id.split(".", 1)[0]


def new_routing_key() -> str:
    return secrets.token_urlsafe(16)


class SessionIds:
    def __init__(self, secret: bytes, model: str) -> None:
        self._secret = secret
        self._model = model

    def _sign(self, key: str, principal: str) -> str:
        mac = hmac.new(self._secret, f"{self._model}\0{key}\0{principal}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:16]).decode().rstrip("=")

    def new(self, principal: str, key: str = "") -> str:
        """A signed id for a new session; ``key`` is the client's routing key, if it sent one."""
        if key and not KEY_PATTERN.fullmatch(key):
            raise InvalidArgument(
                "session_key must be 8-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                reason="INVALID_SESSION_KEY",
                field="session_key",
            )
        key = key or new_routing_key()
        return f"{key}.{self._sign(key, principal)}"

    def verify(self, session_id: str, principal: str) -> str:
        """Return the id if it was issued to ``principal`` for this model; NOT_FOUND otherwise.

        Any string is an answerable question: non-ASCII, over-long or malformed ids are simply
        not found (the signature is compared as bytes, in constant time).
        """
        key, _, sig = session_id.partition(".")
        expected = self._sign(key, principal).encode() if KEY_PATTERN.fullmatch(key) else None
        if expected is None or not sig or not hmac.compare_digest(sig.encode(errors="replace"), expected):
            shown = session_id if len(session_id) <= 80 else session_id[:77] + "..."
            raise NotFound(f"session {shown!r} not found", reason="SESSION_NOT_FOUND")
        return session_id
