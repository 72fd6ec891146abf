"""The chaos soak, short: load and real faults at once, every reply checked against its reference.

``bench/chaos.py --short`` in its own process (it starts and restarts a hotloop-serve of its
own, and SIGKILLs that server's replicas, so the shared test server is never touched): SDK and
HTTP conversations, greedy, deterministic mode, more sessions than ``hot_sessions``, while a
replica is killed, the KV pool is driven full and the whole server restarts with
``persist_dir``. Every invariant of docs/reliability.md must hold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parents[2] / "bench" / "chaos.py"


def test_a_short_chaos_soak_loses_no_turn_and_every_reply_equals_its_reference(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--short", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == [], run.stdout[-4000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The faults really happened, and turns really ran through them and through both APIs.
    assert report["faults"] == {"kill": 1, "kv_full": 1, "restart": 1}
    assert report["turns_in_faults"] >= 5
    assert report["turns_by_api"].get("sdk", 0) >= 8 and report["turns_by_api"].get("http", 0) >= 4
    assert report["turns_by_api"].get("fill", 0) >= 2
    assert report["lost"] == 0 and report["mismatched"] == 0 and report["violations"] == {}
