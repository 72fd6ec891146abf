"""`hotloop-serve apply` and `status` against the running server, through the real CLI.

One application of its own (``gemma-apply``) is added, scaled 1 -> 2 in place, given
autoscaling bounds in place, then rolled by an engine option; each step is checked on the
replica ids Serve reports (kept or new) and on the sessions' follow-up turns (their caches
stay, or follow their keys). The shared apps are listed as "kept" by every apply and must
keep their replicas; ``--prune`` is never used here (it would remove them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from hotloop_client import Client, Message, Role, Session, Settings
from ray import serve

from hotloop_serve.serve.declarative import replicas_by_state

from .conftest import DUO, SINGLE, Server

pytestmark = pytest.mark.integration
APP = "gemma-apply"
GREEDY = Settings(temperature=0, sample_len=8, repeat_penalty=1.0)


def write_config(server: Server, path: Path, grpc_port: int | None = None, seed: int = 0, **model: Any) -> Path:
    doc = {
        "server": {
            "grpc_port": grpc_port or server.config.server.grpc_port,
            "http_port": server.config.server.http_port,
        },
        "telemetry": {"enabled": False},
        "models": [
            {
                "name": APP,
                "engine": {
                    "context_tokens": 8192,
                    "session_context_tokens": 2048,
                    "hot_sessions": 8,
                    "threads": 1,
                    "seed": seed,
                },
                "resources": {"num_cpus": 0.5},
                "graceful_shutdown_timeout_s": 30,
                **model,
            }
        ],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI in its own process, attached to the test session's Ray cluster."""
    env = {**os.environ, "HOTLOOP_HOME": str(home)}
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "hotloop_serve.cli.main", *args, "--ray-address", address]
    t0 = time.monotonic()
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=420)
    print(f"$ hotloop-serve {' '.join(args[:1])} ({time.monotonic() - t0:.1f} s, rc {done.returncode})\n{done.stdout}")
    if done.returncode not in (0, 2):
        print(done.stderr[-3000:])
    return done


def running(app: str) -> set[str]:
    return set(replicas_by_state(app).get("RUNNING", []))


@pytest.fixture
def home(server: Server, tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    if serve.status().applications.get(APP) is not None:
        serve.delete(APP)


def first_turns(sessions: list[Session]) -> list[list[Message]]:
    """One long first turn per session; returns each transcript so far."""
    transcripts = []
    for i, s in enumerate(sessions):
        notes = " ".join(f"Item {j} of list {i} is a {['cat', 'boat', 'tree'][j % 3]}." for j in range(30))
        turn = [Message(Role.USER, f"Remember list {i}: {notes}")]
        reply = "".join(c.text for c in s.generate(turn))
        transcripts.append([*turn, Message(Role.ASSISTANT, reply)])
    return transcripts


def follow_up_shares(sessions: list[Session], transcripts: list[list[Message]], ranks: list[int]) -> list[float]:
    """Each session's next turn: the share of its prompt found cached (hot or restored);
    ``ranks`` gets the rank that served each."""
    shares = []
    for s, transcript in zip(sessions, transcripts, strict=True):
        transcript.append(Message(Role.USER, "Which items are boats?"))
        chunks = list(s.generate(transcript))
        transcript.append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
        usage, served = chunks[-1].usage, chunks[-1].served_by
        assert usage is not None and served is not None
        ranks.append(served.replica_rank)
        shares.append((usage.cached_tokens + usage.restored_tokens) / usage.prompt_tokens)
    return shares


def test_apply_scales_in_place_rolls_engine_changes_and_status_reports(server: Server, home: Path) -> None:
    t_start = time.monotonic()
    shared = {app: running(app) for app in (SINGLE, DUO)}

    added = cli(home, "apply", "--config", str(write_config(server, home / "v1.yaml", replicas=1)))
    assert added.returncode == 0, added.stderr
    assert f"{APP}: is added" in added.stdout
    assert f"{SINGLE}: kept" in added.stdout and f"{DUO}: kept" in added.stdout
    (first,) = running(APP)

    with Client(server.address) as client:
        sessions = [client.model(APP).new_session(settings=GREEDY) for _ in range(4)]
        transcripts = first_turns(sessions)

        scaled = cli(home, "apply", "--config", str(write_config(server, home / "v2.yaml", replicas=2)))
        assert scaled.returncode == 0, scaled.stderr
        assert f"{APP}: changes in place" in scaled.stdout and "num_replicas: 1 -> 2" in scaled.stdout
        assert f"{APP}: 2 replicas running, 1 kept, 1 new" in scaled.stdout
        assert first in running(APP)
        ranks: list[int] = []
        in_place = follow_up_shares(sessions, transcripts, ranks)
        print(f"cached shares after 1 -> 2 in place: {in_place}, served by ranks {ranks}")
        assert sum(share >= 0.9 for share in in_place) >= 3, in_place

        # An engine option and the switch to autoscaling: both change Serve's code version.
        bounds = {"autoscaling": {"min_replicas": 2, "max_replicas": 3, "upscale_delay_s": 60}}
        before_roll = running(APP)
        rolled = cli(home, "apply", "--config", str(write_config(server, home / "v3.yaml", seed=3, **bounds)))
        assert rolled.returncode == 0, rolled.stderr
        assert f"{APP}: rolls" in rolled.stdout and "models[gemma-apply].engine.seed: 0 -> 3" in rolled.stdout
        assert "switching to autoscaling" in rolled.stdout
        assert f"{APP}: 2 replicas running, 0 kept, 2 new" in rolled.stdout
        assert not running(APP) & before_roll
        ranks = []
        after_roll = follow_up_shares(sessions, transcripts, ranks)
        print(f"cached shares after the roll: {after_roll}, served by ranks {ranks}")
        assert sum(share >= 0.9 for share in after_roll) >= 3, after_roll

        bounds = {"autoscaling": {"min_replicas": 2, "max_replicas": 4, "upscale_delay_s": 60}}
        bounded = cli(home, "apply", "--config", str(write_config(server, home / "v4.yaml", seed=3, **bounds)))
        assert bounded.returncode == 0, bounded.stderr
        assert (
            f"{APP}: changes in place" in bounded.stdout and "autoscaling_config.max_replicas: 3 -> 4" in bounded.stdout
        )
        assert f"{APP}: 2 replicas running, 2 kept, 0 new" in bounded.stdout

        status = cli(home, "status", "--json")
        assert status.returncode == 0, status.stderr
        view = {m["name"]: m for m in json.loads(status.stdout)}[APP]
        assert view["target"] == "autoscaling 2..4"
        live = [r for r in view["replicas"] if r["state"] == "RUNNING"]
        assert sorted(r["rank"] for r in live) == [0, 1] and all(r["error"] is None for r in live), live
        turns = sum(r["stats"]["turns"] for r in live)
        prompt = sum(r["stats"]["prompt_tokens"] for r in live)
        cached = sum(r["stats"]["cached_tokens"] + r["stats"]["restored_tokens"] for r in live)
        assert turns >= 4 and cached / prompt > 0.6, (turns, cached, prompt)  # the follow-ups after the roll
        assert sum(r["stats"]["hot_sessions"] + r["stats"]["evicted_sessions"] for r in live) >= 4
        table = cli(home, "status")
        assert table.returncode == 0 and f"{APP}: RUNNING, autoscaling 2..4, cache hit" in table.stdout

    moved = cli(home, "apply", "--config", str(write_config(server, home / "v5.yaml", grpc_port=1, **bounds)))
    assert moved.returncode == 2
    assert "refused: server.grpc_port" in moved.stdout and "nothing was changed" in moved.stdout
    assert {app: running(app) for app in (SINGLE, DUO)} == shared  # every apply kept the shared apps' replicas
    print(f"({time.monotonic() - t_start:.0f} s)")
