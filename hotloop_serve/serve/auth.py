"""Bearer-token authentication: token -> principal, checked on every RPC.

Tokens come from the config inline, a file of ``principal:token`` lines (a mounted
Kubernetes Secret) or an environment variable. With none configured, auth is off and
every caller is the principal ``anonymous``.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from hotloop_serve.config import AuthConfig
from hotloop_serve.errors import Unauthenticated

ANONYMOUS = "anonymous"


def _pairs(text: str, separators: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in text.replace(separators, "\n").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        principal, sep, token = line.partition(":")
        if not sep or not principal.strip() or not token.strip():
            raise ValueError("token entries must look like 'principal:token'")
        out[principal.strip()] = token.strip()
    return out


def load_tokens(cfg: AuthConfig) -> dict[str, str]:
    """principal -> token from every configured source (later sources win)."""
    tokens = dict(cfg.tokens)
    if cfg.tokens_file:
        tokens.update(_pairs(Path(cfg.tokens_file).read_text(), "\n"))
    if cfg.tokens_env:
        tokens.update(_pairs(os.environ.get(cfg.tokens_env, ""), ","))
    return tokens


class Authenticator:
    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = [(p, t.encode()) for p, t in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The caller's principal from its ``authorization: Bearer <token>`` metadata."""
        if not self._tokens:
            return ANONYMOUS
        header = next((v for k, v in metadata if k == "authorization"), None)
        if header is None:
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token>'")
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("malformed authorization metadata: expected 'Bearer <token>'")
        given = token.strip().encode()
        found = None
        for principal, expected in self._tokens:  # compare with every token: timing reveals nothing
            if hmac.compare_digest(given, expected):
                found = principal
        if found is None:
            raise Unauthenticated("invalid bearer token")
        return found
