"""Download model files into a shared volume, verifying each one's sha256 (init container).

Environment: HOTLOOP_MODEL_DIR (destination directory), HOTLOOP_MODEL_FILES (JSON list of
{"url", "sha256", "filename"}), optional HOTLOOP_FETCH_TOKEN (sent as a bearer token).
A file already present with the right digest is kept, so restarts and a cache PVC skip the
download. A download goes to a temporary name and is renamed only once its digest matches.
Standard library only: it runs in the hotloop image (or any image with Python 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.request

CHUNK = 1 << 20


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def fetch(url: str, sha256: str, dest: str, token: str | None) -> None:
    if os.path.exists(dest) and file_sha256(dest) == sha256:
        print(f"{dest}: present, sha256 ok", flush=True)
        return
    request = urllib.request.Request(url, headers={"User-Agent": "hotloop-serve-fetch"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".fetch-", suffix=".part")
    h = hashlib.sha256()
    size = 0
    start = time.monotonic()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=60) as response:
            while block := response.read(CHUNK):
                h.update(block)
                out.write(block)
                size += len(block)
        got = h.hexdigest()
        if got != sha256:
            raise SystemExit(f"{url}: sha256 mismatch: expected {sha256}, got {got} ({size} bytes)")
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"{dest}: {size} bytes in {time.monotonic() - start:.1f} s, sha256 ok", flush=True)


def main() -> None:
    directory = os.environ["HOTLOOP_MODEL_DIR"]
    files = json.loads(os.environ["HOTLOOP_MODEL_FILES"])
    token = os.environ.get("HOTLOOP_FETCH_TOKEN") or None
    os.makedirs(directory, exist_ok=True)
    for spec in files:
        name = spec["filename"]
        if os.sep in name or name in ("", ".", ".."):
            raise SystemExit(f"{name!r}: filename must be a plain file name")
        fetch(spec["url"], spec["sha256"].lower(), os.path.join(directory, name), token)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception as exc:
        sys.exit(f"fetch_model: {type(exc).__name__}: {exc}")
