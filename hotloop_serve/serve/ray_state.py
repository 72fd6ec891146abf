"""Where a running ``hotloop-serve run`` is, for later CLI calls: its Ray address and auth mode.

No Ray import at module level: a connecting process must set ``RAY_AUTH_MODE`` before Ray
reads its configuration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

AUTH_MODE_ENV = "RAY_AUTH_MODE"
"""A local cluster that ``ray.init()`` starts uses token auth by default (Ray 2.60) and sets
this variable in the starting process only. Another process must set it too to present the
token (``~/.ray/auth_token``, shared by the user's processes); the token itself is never
written to the state file."""

STATE_FILE = "ray.json"
"""Where ``hotloop-serve run`` records its Ray address (in the CLI's state directory)."""


def record_address(state_dir: Path) -> None:
    """Called by ``run`` once Ray is up: later ``apply``/``status`` calls find the cluster here."""
    import ray

    address = ray.get_runtime_context().gcs_address
    record = {"address": address, "pid": os.getpid(), "auth_mode": os.environ.get(AUTH_MODE_ENV)}
    (state_dir / STATE_FILE).write_text(json.dumps(record))


def recorded(state_dir: Path) -> tuple[str, str | None] | None:
    """(Ray address, auth mode) that a running ``hotloop-serve run`` recorded, if any."""
    f = state_dir / STATE_FILE
    if not f.exists():
        return None
    data = json.loads(f.read_text())
    try:
        os.kill(int(data["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError):
        f.unlink(missing_ok=True)
        return None
    return str(data["address"]), data.get("auth_mode")


def use_auth_mode(auth_mode: str | None) -> None:
    """Present the cluster's auth mode (an explicit ``RAY_AUTH_MODE`` wins), and make an already
    imported Ray read it again (as Ray's own ``_enable_token_auth`` does)."""
    if not auth_mode or AUTH_MODE_ENV in os.environ:
        return
    os.environ[AUTH_MODE_ENV] = auth_mode
    import sys

    if "ray._raylet" in sys.modules:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
