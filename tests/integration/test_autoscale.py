"""Autoscaling keeps session caches both ways: load scales 1 -> 2 replicas, idleness back to 1.

``gemma-autoscale`` (autoscaling min 1, max 2, short delays and look-back window) serves
concurrent chat sessions until Serve adds a replica; the sessions whose keys the new replica
owns are fetched from the old owner on first use. Then the load stops, Serve removes a
replica, and the leaving one hands its sessions over in its graceful shutdown. Every turn
must succeed, and follow-ups must find their history cached on both sides of each change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hotloop_client import Client, Message, Role, Session, Settings
from ray import serve

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.serve.app import model_app
from hotloop_serve.serve.declarative import replicas_by_state

from .conftest import Server

pytestmark = pytest.mark.integration
APP = "gemma-autoscale"
SECRET = "autoscale-secret-0123456789abcdef"
SESSIONS = 6
TURNS_AFTER_SCALE_OUT = 2
"""The load goes on until the new replica has served a turn and every session has started this
many turns since the scale-out, however slow the machine (a first turn of 6 sessions at once
takes 10-40 s on two shared cores): the routers have learnt of the new replica by then."""
LOAD_TIMEOUT_S = 240
GREEDY = Settings(temperature=0, sample_len=16, repeat_penalty=1.0)


def app_config(server: Server) -> Config:
    doc = server.config.model_dump(mode="json")
    doc["models"] = [
        {
            "name": APP,
            "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                            "upscale_delay_s": 2, "downscale_delay_s": 8, "look_back_period_s": 6},
            "engine": {"context_tokens": 16384, "session_context_tokens": 2048, "hot_sessions": 8, "threads": 1},
            "resources": {"num_cpus": 0.5},
            "graceful_shutdown_timeout_s": 30,
        }
    ]  # fmt: skip
    return config_from_dict(doc)


@pytest.fixture
def autoscaled(server: Server) -> Iterator[Server]:
    config = app_config(server)
    serve.run(model_app(config, config.models[0], SECRET), name=APP, route_prefix=f"/{APP}")
    yield server
    if serve.status().applications.get(APP) is not None:
        serve.delete(APP)


@dataclass
class Turn:
    session: int
    started: float
    at: float
    replica: str
    share: float


@dataclass
class Chat:
    """One session and its transcript; each turn appends the real reply, so the next prompt
    starts with exactly what the replica cached."""

    index: int
    session: Session
    transcript: list[Message] = field(default_factory=list)

    def turn(self, text: str) -> Turn:
        self.transcript.append(Message(Role.USER, text))
        started = time.monotonic()
        chunks = list(self.session.generate(self.transcript))
        self.transcript.append(Message(Role.ASSISTANT, "".join(c.text for c in chunks)))
        last = chunks[-1]
        assert last.usage is not None and last.served_by is not None
        share = (last.usage.cached_tokens + last.usage.restored_tokens) / last.usage.prompt_tokens
        return Turn(self.index, started, time.monotonic(), last.served_by.replica, share)


def paths(turns: list[Turn], first: str) -> dict[int, str]:
    """Per session, ``1`` for a turn on the first replica and ``2`` for one elsewhere."""
    out: dict[int, str] = {}
    for t in sorted(turns, key=lambda t: t.at):
        out[t.session] = out.get(t.session, "") + ("1" if t.replica == first else "2")
    return out


def running() -> list[str]:
    return replicas_by_state(APP).get("RUNNING", [])


def wait_for(replicas: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while len(running()) != replicas or set(replicas_by_state(APP)) - {"RUNNING"}:
        assert time.monotonic() - t0 < timeout_s, (
            f"not {replicas} replicas after {timeout_s} s: {replicas_by_state(APP)}"
        )
        time.sleep(0.5)
    return time.monotonic() - t0


def test_autoscaling_out_and_in_keeps_session_caches(autoscaled: Server) -> None:
    t_start = time.monotonic()
    wait_for(1, 120)
    (first,) = running()
    turns: list[Turn] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    with Client(autoscaled.address) as client:
        chats = [Chat(i, client.model(APP).new_session(settings=GREEDY)) for i in range(SESSIONS)]

        def drive(chat: Chat) -> None:
            notes = " ".join(f"Item {j} of list {chat.index} is a {['cat', 'boat', 'tree'][j % 3]}." for j in range(30))
            try:
                turns.append(chat.turn(f"Remember list {chat.index}: {notes}"))
                n = 0
                while not stop.is_set():
                    n += 1
                    turns.append(chat.turn(f"Question {n}: name one boat."))
            except BaseException as e:
                failures.append(e)

        threads = [threading.Thread(target=drive, args=(c,)) for c in chats]
        for t in threads:
            t.start()
        scaled_out_s = wait_for(2, 150)
        (second,) = set(running()) - {first}
        scaled_out_at = time.monotonic()

        def started_since(chat: Chat) -> int:
            return sum(1 for t in list(turns) if t.session == chat.index and t.started > scaled_out_at)

        def served_by_new() -> bool:
            return any(t.replica == second for t in list(turns))

        # The sessions the new replica owns come to it (fetched on first use).
        while not failures and not (served_by_new() and min(map(started_since, chats)) >= TURNS_AFTER_SCALE_OUT):
            assert time.monotonic() - scaled_out_at < LOAD_TIMEOUT_S, [started_since(c) for c in chats]
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not failures, failures
        out = [t for t in turns if t.replica == second]
        moved = {t.session for t in out}
        first_on_new = [min((t for t in out if t.session == s), key=lambda t: t.at) for s in moved]

        scaled_in_s = wait_for(1, 150)
        (left,) = running()
        back = [chat.turn("Last question: how many lists did I give you?") for chat in chats]

    print(
        f"\nscale-out after {scaled_out_s:.0f} s of load; {len(moved)} of {SESSIONS} moved to the new replica, "
        f"their first turns there cached {[round(t.share, 3) for t in first_on_new]}"
        f"\nscale-in {scaled_in_s:.0f} s after the load stopped (kept {'first' if left == first else 'second'}); "
        f"follow-ups cached {[round(t.share, 3) for t in back]}"
        f"\nreplicas per session, turn by turn: {paths(turns, first)}"
        f"\n{len(turns) + len(back)} turns, none failed ({time.monotonic() - t_start:.0f} s)"
    )
    assert moved, "no session moved to the new replica"
    assert all(t.share >= 0.9 for t in first_on_new), first_on_new  # fetched from the old owner
    assert all(t.replica == left for t in back)
    assert sum(t.share >= 0.9 for t in back) >= SESSIONS - 1, back  # handed over (one may race the shutdown)
