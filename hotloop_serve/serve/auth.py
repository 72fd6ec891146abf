"""Bearer-token authentication: token -> principal, checked on every RPC.

Tokens come from the config inline, a file of ``principal:token`` lines (a mounted
Kubernetes Secret) or an environment variable of comma-separated pairs. A principal may hold
several tokens (list it once per token: rotation without downtime). With no token source
configured, auth is off and every caller is the principal ``anonymous``.

Loading fails closed (:func:`load_tokens` raises ``ValueError`` naming the source): a
configured source that yields no token (an unset variable, an empty or missing file), a token
shorter than :data:`MIN_TOKEN_LENGTH`, or one token given to two principals. Repeated entries
are reported in the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hotloop_serve.config import AuthConfig
from hotloop_serve.errors import Unauthenticated

ANONYMOUS = "anonymous"
MIN_TOKEN_LENGTH = 16
"""Shortest bearer token accepted from the config (16 random characters: ~96 bits)."""

log = logging.getLogger(__name__)


def _entries(text: str, separator: str, source: str) -> list[tuple[str, str]]:
    """``principal:token`` entries of ``text``, one per line (or per ``separator``)."""
    out: list[tuple[str, str]] = []
    for raw in text.replace(separator, "\n").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        principal, sep, token = line.partition(":")
        if not sep or not principal.strip() or not token.strip():
            raise ValueError(f"{source}: token entries must look like 'principal:token'")
        out.append((principal.strip(), token.strip()))
    return out


def _sources(cfg: AuthConfig) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each configured source with its entries; a source configured but empty is an error."""
    sources: list[tuple[str, list[tuple[str, str]]]] = []
    if cfg.tokens:
        sources.append(("auth.tokens", list(cfg.tokens.items())))
    if cfg.tokens_file:
        name = f"auth.tokens_file ({cfg.tokens_file})"
        try:
            text = Path(cfg.tokens_file).read_text()
        except OSError as exc:
            raise ValueError(f"{name} cannot be read: {exc.strerror or exc}; refusing to start without auth") from exc
        sources.append((name, _entries(text, "\n", name)))
    if cfg.tokens_env:
        name = f"auth.tokens_env (${cfg.tokens_env})"
        value = os.environ.get(cfg.tokens_env)
        if value is None:
            raise ValueError(f"{name} is not set; refusing to start without auth")
        sources.append((name, _entries(value, ",", name)))
    for name, entries in sources:
        if not entries:
            raise ValueError(f"{name} holds no 'principal:token' entry; refusing to start without auth")
    return sources


def load_tokens(cfg: AuthConfig) -> dict[str, tuple[str, ...]]:
    """principal -> its tokens, from every configured source ({} when none is: auth off)."""
    tokens: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for source, entries in _sources(cfg):
        for principal, token in entries:
            if len(token) < MIN_TOKEN_LENGTH:
                raise ValueError(
                    f"{source}: the token of {principal!r} has {len(token)} characters; "
                    f"at least {MIN_TOKEN_LENGTH} are required"
                )
            if owner.get(token, principal) != principal:
                raise ValueError(f"{source}: one token is given to both {owner[token]!r} and {principal!r}")
            if token in tokens.get(principal, ()):
                log.warning("auth: %s repeats a token of %r (ignored)", source, principal)
                continue
            owner[token] = principal
            tokens.setdefault(principal, []).append(token)
    return {p: tuple(t) for p, t in tokens.items()}


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) is on
    this machine. Ray's proxy passes the original caller's peer to the replica."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def describe_tokens(tokens: Mapping[str, Sequence[str]], anonymous: str = "local") -> str:
    """For the start-up log: how many principals and tokens, never the tokens."""
    if not tokens:
        who = "from this machine only" if anonymous == "local" else "from the network (auth.anonymous: network)"
        return f"auth off: anonymous callers accepted {who}"
    n = sum(len(t) for t in tokens.values())
    return f"auth on: {len(tokens)} principal(s), {n} token(s)"


class Authenticator:
    """Checks ``authorization: Bearer <token>`` against every known token.

    With no token, every caller is ``anonymous``, accepted from this machine only unless
    ``anonymous="network"`` says otherwise in so many words.
    """

    def __init__(self, tokens: Mapping[str, str | Sequence[str]], anonymous: str = "local") -> None:
        self._tokens = [
            (principal, token.encode())
            for principal, given in tokens.items()
            for token in ((given,) if isinstance(given, str) else given)
        ]
        self._anonymous_from_network = anonymous == "network"

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]], peer: str | None = None) -> str:
        """The caller's principal from its ``authorization: Bearer <token>`` metadata; ``peer``
        is the caller's address (``grpc_context.peer()``; None for in-process calls)."""
        if not self._tokens:
            if peer is None or self._anonymous_from_network or is_local_peer(peer):
                return ANONYMOUS
            raise Unauthenticated(
                "this server has no auth tokens, so it accepts calls from its own machine only; "
                "configure auth tokens, or set auth.anonymous: network to serve anyone who reaches the port",
                reason="ANONYMOUS_FROM_NETWORK",
            )
        header = next((v for k, v in metadata if k == "authorization"), None)
        if header is None:
            raise Unauthenticated(
                "missing bearer token: send metadata 'authorization: Bearer <token>'", reason="TOKEN_MISSING"
            )
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated(
                "malformed authorization metadata: expected 'Bearer <token>'", reason="TOKEN_MALFORMED"
            )
        given = token.strip().encode(errors="replace")
        found = None
        for principal, expected in self._tokens:  # compare with every token: timing reveals nothing
            if hmac.compare_digest(given, expected):
                found = principal
        if found is None:
            raise Unauthenticated("invalid bearer token", reason="TOKEN_INVALID")
        return found


def export_secrets(auth: AuthConfig, session_secret: str) -> list[bytes]:
    """The secrets session blobs are signed with (``persist.BlobKeys``): the export keys from
    ``auth.export_keys_env``, the first of which signs, then the session secret."""
    name = auth.export_keys_env
    listed = os.environ.get(name, "") if name else ""
    keys = [k.strip() for k in listed.split(",") if k.strip()]
    short = [k for k in keys if len(k) < 16]
    if short:
        raise ValueError(f"{name}: every export key must be at least 16 characters ({len(short)} are shorter)")
    return [k.encode() for k in keys] + [session_secret.encode()]
