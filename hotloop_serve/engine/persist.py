"""A session's cache outside the KV memory: one signed blob, and a directory of them.

The blob (:class:`SessionBlob`) is what ``ExportSession`` streams out, ``ImportSession`` takes
in, and the disk tier stores: the cached tokens, llama.cpp's state of the sequence, the
session's settings, and the fingerprint of the model that computed it, closed by an
HMAC-SHA256 of everything before it under a key of this fleet (:class:`BlobKeys`). llama.cpp
trusts a state's contents (a state whose cells do not match its tokens makes the next decode
fail for every session in the batch), so a blob is loaded only if this fleet made it: a blob
signed by another key, damaged or forged, is refused before a byte of it is parsed. Fleets
that share a key (``HOTLOOP_EXPORT_KEYS``, or the same session secret) move sessions between
them; a list of keys lets an operator rotate (the first signs, every one verifies). A blob of
another model is refused as well (the KV of one model means nothing to another), and
``kv_state.py`` checks the state against the tokens before llama.cpp reads it.

The disk tier (:class:`DiskStore`) keeps sessions that would otherwise be lost: dropped from
host RAM past its budget, or hot at a graceful shutdown. Files are written atomically (a
temporary file renamed into place), named by a hash of the session id, bound to the owning
principal (another principal's request never loads them), signed like exports, and kept
under a byte budget, least recently used first. A file that cannot be read or verified is a
cache miss: logged, deleted, never an error for the request.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotloop_serve.bounded_json import loads as bounded_loads
from hotloop_serve.engine.session import KVBytes
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

MAGIC = b"HOTLOOP-SESSION\x02"
"""Format 2: signed. Format 1 (a plain SHA-256, which anyone can recompute) is refused."""
_OLD_MAGIC = b"HOTLOOP-SESSION\x01"
_KEY_ID = 8
_MAC = 32
MAX_BLOB_BYTES = 1 << 31
MAX_HEADER_BYTES = 1 << 20
"""Longest blob header (JSON: fingerprint, owner, counts, settings with a grammar of up to 64 KiB)."""
_HEADER_DEPTH = 8


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"hotloop blob key id\0" + key).digest()[:_KEY_ID]


class BlobKeys:
    """The keys that sign and verify session blobs: the first signs, every one verifies.

    Blobs name the key that signed them by an 8-byte id (a hash of the key, which reveals
    nothing of it), so verifying under several keys costs one HMAC, and a rotation is: add the
    new key first, keep the old one after it until the old blobs are gone, then drop it.
    """

    def __init__(self, keys: list[bytes]) -> None:
        if not keys or any(len(k) < 16 for k in keys):
            raise ValueError("blob keys must be at least 16 bytes each, and there must be one")
        self._signing = keys[0]
        self._by_id = {_key_id(k): k for k in keys}

    @classmethod
    def derived(cls, secrets_: list[bytes]) -> BlobKeys:
        """Keys derived from secrets shared by a fleet (the session secret, export keys): a key
        of its own per purpose, so a blob's MAC never doubles as a session id's signature."""
        return cls([hmac.new(s, b"hotloop session blob v2", hashlib.sha256).digest() for s in secrets_])

    @classmethod
    def ephemeral(cls) -> BlobKeys:
        """A key of this process alone: its blobs load only here (an engine given no keys)."""
        return cls([secrets.token_bytes(32)])

    def sign(self, body: bytes) -> bytes:
        """The trailer of ``body``: the signing key's id and the MAC over body and id."""
        kid = _key_id(self._signing)
        return kid + hmac.new(self._signing, body + kid, hashlib.sha256).digest()

    def verify(self, data: bytes) -> bool:
        """Whether ``data`` (body + trailer) was signed by one of these keys."""
        body_end = len(data) - _KEY_ID - _MAC
        kid, mac = data[body_end : body_end + _KEY_ID], data[body_end + _KEY_ID :]
        key = self._by_id.get(kid)
        if key is None:
            return False
        h = hmac.new(key, memoryview(data)[:body_end], hashlib.sha256)
        h.update(kid)
        return hmac.compare_digest(h.digest(), mac)


def model_fingerprint(path: str | Path) -> str:
    """Identifies a model file cheaply: its size and the SHA-256 of its first and last MiB.

    The header (architecture, tensor shapes, tokenizer) and the tail of the weights differ
    between any two models worth telling apart; hashing 250 MB to 40 GB on every start is not
    worth the last bit of certainty.
    """
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with p.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def settings_to_dict(s: SamplingSettings) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    d["stop"] = list(s.stop)
    return d


def settings_from_dict(d: dict[str, Any]) -> SamplingSettings:
    known = {f.name for f in dataclasses.fields(SamplingSettings)}
    given = {k: v for k, v in d.items() if k in known}
    given["stop"] = tuple(given.get("stop", ()))
    return SamplingSettings(**given)


@dataclass(frozen=True)
class SessionBlob:
    """A session's cache, portable between servers of the same model."""

    fingerprint: str
    tokens: list[int]
    settings: SamplingSettings
    kv: bytes
    owner: str = ""
    """Set on disk files only (the principal allowed to load them); exports carry none."""

    def encode(self, keys: BlobKeys) -> bytes:
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "owner": self.owner,
                "n_tokens": len(self.tokens),
                "kv_bytes": len(self.kv),
                "settings": settings_to_dict(self.settings),
            }
        ).encode()
        body = b"".join(
            (MAGIC, struct.pack("<I", len(header)), header, struct.pack(f"<{len(self.tokens)}i", *self.tokens), self.kv)
        )
        return body + keys.sign(body)

    @classmethod
    def decode(cls, data: bytes, fingerprint: str, keys: BlobKeys) -> SessionBlob:
        """Verify, then parse: InvalidArgument for a blob this fleet did not sign (or damaged, or
        malformed), FailedPrecondition for another model's. Nothing is parsed before the MAC holds."""
        if data.startswith(_OLD_MAGIC):
            raise InvalidArgument(
                "session export is of an older, unsigned format; export it again from a current server"
            )
        if len(data) < len(MAGIC) + 4 + _KEY_ID + _MAC or not data.startswith(MAGIC):
            raise InvalidArgument("not a hotloop session export (bad magic or too short)")
        if len(data) > MAX_BLOB_BYTES:
            raise InvalidArgument(f"session export is {len(data)} bytes; at most {MAX_BLOB_BYTES}")
        if not keys.verify(data):
            raise InvalidArgument(
                "session export is damaged or was not made by this fleet: its signature does not match any of "
                "this server's export keys (servers that share HOTLOOP_EXPORT_KEYS or the session secret accept "
                "each other's exports; docs/sessions.md)",
                reason="EXPORT_SIGNATURE_MISMATCH",
            )
        body = data[: -_KEY_ID - _MAC]
        (hlen,) = struct.unpack_from("<I", body, len(MAGIC))
        start = len(MAGIC) + 4
        if hlen > MAX_HEADER_BYTES or start + hlen > len(body):
            raise InvalidArgument(f"session export has a header of {hlen} bytes (at most {MAX_HEADER_BYTES})")
        header = bounded_loads(body[start : start + hlen], "session export header", max_depth=_HEADER_DEPTH)
        try:
            if not isinstance(header, dict) or not isinstance(header.get("settings"), dict):
                raise TypeError("the header is not an object with settings")
            n, kv_bytes = int(header["n_tokens"]), int(header["kv_bytes"])
            settings = settings_from_dict(header["settings"])
            found, owner = str(header["fingerprint"]), str(header.get("owner", ""))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"session export has a bad header: {e}") from None
        if found != fingerprint:
            raise FailedPrecondition(
                "session export was made with another model (fingerprint mismatch); "
                "import it into a server of that model"
            )
        pos = start + hlen
        if n < 0 or kv_bytes < 0 or pos + 4 * n + kv_bytes != len(body):
            raise InvalidArgument("session export is truncated or has trailing data")
        tokens = list(struct.unpack_from(f"<{n}i", body, pos))
        kv = body[pos + 4 * n :]
        return cls(found, tokens, settings, kv, owner)


def to_kv_bytes(data: bytes) -> KVBytes:
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)


class DiskStore:
    """Session blobs in a directory, LRU within a byte budget. Thread-safe."""

    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: str, keys: BlobKeys) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self.fingerprint = fingerprint
        self.keys = keys
        self._lock = threading.Lock()

    def _path(self, session_id: str) -> Path:
        return self.dir / (hashlib.sha256(session_id.encode()).hexdigest()[:40] + ".session")

    def put(self, session_id: str, blob: SessionBlob) -> bool:
        """Write atomically; False (and nothing on disk) if it does not fit the budget."""
        data = blob.encode(self.keys)
        if len(data) > self.budget:
            return False
        path = self._path(session_id)
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".session")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not persist session to %s: %s", path, e)
                Path(tmp).unlink(missing_ok=True)
                return False
            self._enforce_budget(keep=path)
        return True

    def get(self, session_id: str, owner: str) -> SessionBlob | None:
        """The session's blob if it exists, verifies, and belongs to ``owner``; else None."""
        path = self._path(session_id)
        with self._lock:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as e:
                log.warning("could not read persisted session %s: %s", path, e)
                return None
            try:
                blob = SessionBlob.decode(data, self.fingerprint, self.keys)
            except (InvalidArgument, FailedPrecondition) as e:
                log.warning("discarding persisted session %s: %s", path.name, e.message)
                path.unlink(missing_ok=True)
                return None
            if blob.owner != owner:
                return None  # another principal's session: as if there were none
            os.utime(path)  # most recently used
            return blob

    def delete(self, session_id: str) -> None:
        with self._lock:
            self._path(session_id).unlink(missing_ok=True)

    def _files(self) -> list[tuple[Path, os.stat_result]]:
        """Complete session files with their stats. Temporary files (another replica's write in
        progress, when replicas share the directory) are not counted, and a file removed
        meanwhile is skipped."""
        found = []
        for f in self.dir.glob("*.session"):
            if f.name.startswith("."):
                continue
            try:
                found.append((f, f.stat()))
            except FileNotFoundError:
                continue
        return found

    def usage(self) -> tuple[int, int]:
        """(files, bytes) on disk."""
        files = self._files()
        return len(files), sum(st.st_size for _, st in files)

    def _enforce_budget(self, keep: Path) -> None:
        files = sorted(self._files(), key=lambda item: item[1].st_mtime)
        total = sum(st.st_size for _, st in files)
        for f, st in files:
            if total <= self.budget:
                break
            if f == keep:
                continue
            total -= st.st_size
            f.unlink(missing_ok=True)
