"""A Ray cluster of three nodes on this machine: replicas on two of them, one node lost mid-conversation.

The scenario is ``bench/multinode.py`` run small, in its own process: it starts a Ray cluster
of its own (``ray.cluster_utils.Cluster``), which this test process, connected to the shared
server's Ray, could not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parents[2] / "bench" / "multinode.py"
NODE_START_TIMEOUT = "timed out during startup"
"""Ray's error when a node's raylet did not come up in time: the cluster, not the scenario, failed."""


def test_a_lost_node_loses_no_turn_and_its_replacement_fetches_the_moved_caches(tmp_path: Path) -> None:
    out = tmp_path / "multinode.json"
    for _ in range(2):  # once more when Ray's simulated node did not start (2 cores shared by 3 nodes)
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--sessions", "4", "--sample-len", "6", "--json", str(out)],
            check=False,
            capture_output=True,
            text=True,
            timeout=540,
        )
        if run.returncode == 0 or NODE_START_TIMEOUT not in run.stderr:
            break
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["facts"]["nodes_of_replicas"] == 2  # the two replicas on two nodes
    assert result["facts"]["sessions_on_lost_node"] >= 1
    rows = {r["step"]: r for r in result["rows"]}
    assert all(r["failed"] == 0 for r in rows.values())  # the SDK's retry plus a rebuild
    lost, replaced = rows["2. node lost"], rows["3. node replaced"]
    assert lost["moved"] == result["facts"]["sessions_on_lost_node"]  # exactly the lost node's sessions moved
    # Back on their rank's replacement, which fetched their caches from the runner-up.
    assert replaced["moved"] == lost["moved"] and replaced["moved_cached_share"] > 0.5
