"""Session operations on a real engine (tiny model): fork, edit, list, export/import, disk persistence."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from hotloop_serve.engine import ChatMessage as M
from hotloop_serve.engine import Engine, EngineOptions, SamplingSettings
from hotloop_serve.engine.persist import BlobKeys, DiskStore, model_fingerprint
from hotloop_serve.errors import FailedPrecondition, InvalidArgument, NotFound

GREEDY = SamplingSettings(temperature=0, sample_len=16, repeat_penalty=1.0)
KEYS = BlobKeys([b"a fleet's shared export key"])
"""Engines that move sessions between them share a key (each would make its own otherwise)."""
OPTS = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4)


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as e:
        yield e


def settle(e: Engine) -> None:
    for _ in range(400):
        if e.stats().active_requests == 0:
            return
        time.sleep(0.005)
    raise AssertionError(e.stats())


def chat(n_turns: int) -> list[M]:
    msgs = [M("system", "You are a test.")]
    for i in range(n_turns):
        msgs += [M("user", f"question {i} about things"), M("assistant", f"answer {i}")]
    return msgs


def fresh_text(model: Path, history: list[M]) -> str:
    with Engine(str(model), OPTS, blob_keys=KEYS) as e:
        return e.generate("fresh", "p", history, GREEDY).result().text


def test_fork_then_diverge(engine: Engine, tiny_model: Path) -> None:
    base = chat(2)
    engine.generate("a", "p", [*base, M("user", "go")], GREEDY).result()
    settle(engine)
    held = engine.session_info("a", "p").context_tokens
    info = engine.fork_session("a", "p", "b", messages=base)  # fork from the end of turn 2
    assert 0 < info.context_tokens < held and info.state == "hot"
    left = [*base, M("user", "left branch")]
    right = [*base, M("user", "right branch")]
    r_left = engine.generate("a", "p", left, GREEDY).result()
    r_right = engine.generate("b", "p", right, GREEDY).result()
    assert r_right.usage is not None and r_right.usage.cached_tokens == info.context_tokens
    assert r_right.usage.prefilled_tokens == r_right.usage.prompt_tokens - info.context_tokens
    assert r_left.text == fresh_text(tiny_model, left)
    assert r_right.text == fresh_text(tiny_model, right)
    with pytest.raises(NotFound):
        engine.fork_session("a", "mallory", "c")
    with pytest.raises(FailedPrecondition):
        engine.fork_session("a", "p", "b")


def test_fork_of_an_evicted_session(tiny_model: Path) -> None:
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=2)) as e:
        e.generate("a", "p", chat(3), GREEDY).result()
        settle(e)
        e.generate("x", "p", [M("user", "other")], GREEDY).result()
        settle(e)
        e.generate("y", "p", [M("user", "more")], GREEDY).result()
        settle(e)
        assert e.session_info("a", "p").state == "evicted"
        info = e.fork_session("a", "p", "b", messages=chat(1))
        assert info.context_tokens > 0
        nxt = [*chat(1), M("user", "then?")]
        r = e.generate("b", "p", nxt, GREEDY).result()
    assert r.usage is not None and r.usage.cached_tokens == info.context_tokens
    assert r.text == fresh_text(tiny_model, nxt)


def test_editing_turn_one_of_four_reuses_exactly_the_tokens_before_it(engine: Engine, tiny_model: Path) -> None:
    history = [*chat(4), M("user", "last")]
    engine.generate("s", "p", history, GREEDY).result()
    settle(engine)
    edited = list(history)
    edited[1] = M("user", "question 0 was different")
    r = engine.generate("s", "p", edited, GREEDY).result()
    prefix = 0
    a, b = engine.render(history), engine.render(edited)
    while a[prefix] == b[prefix]:
        prefix += 1
    assert r.usage is not None and r.usage.cached_tokens == prefix
    assert r.text == fresh_text(tiny_model, edited)


def test_list_shows_only_the_callers_sessions(engine: Engine) -> None:
    engine.generate("a", "p", chat(1), GREEDY).result()
    settle(engine)  # the reply's last token is cached one step after the final chunk
    engine.create_session("b", "p")
    engine.create_session("c", "q")
    settle(engine)
    mine = engine.list_sessions("p")
    assert [i.id for i in mine] == ["b", "a"]  # most recently used first
    assert mine[1].context_tokens > 0 and mine[1].last_used > time.time() - 60
    assert [i.id for i in engine.list_sessions("q")] == ["c"]


def test_export_then_import_into_another_engine(tiny_model: Path) -> None:
    turn2 = [*chat(2), M("user", "next")]
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as a:
        a.generate("s", "p", chat(2), GREEDY).result()
        settle(a)
        blob = a.export_session("s", "p")
        expected = a.generate("s", "p", turn2, GREEDY).result()
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as b:
        info = b.import_session("t", "q", blob)
        assert info.state == "hot" and info.context_tokens > 0
        got = b.generate("t", "q", turn2, GREEDY).result()
        with pytest.raises(FailedPrecondition):
            b.import_session("t", "q", blob)
    assert got.usage is not None and expected.usage is not None
    assert got.usage.cached_tokens == expected.usage.cached_tokens > 0
    assert got.text == expected.text


def test_an_import_while_every_sequence_decodes_waits_in_ram_and_continues_its_cache(tiny_model: Path) -> None:
    """Found by the chaos soak: with every sequence busy, an import could not take one and was
    refused as "its state is invalid" (INVALID_ARGUMENT). The blob is valid: it waits in host RAM
    as an evicted session and is restored on its next turn."""
    turn2 = [*chat(2), M("user", "next")]
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as a:
        a.generate("s", "p", chat(2), GREEDY).result()
        settle(a)
        blob = a.export_session("s", "p")
        expected = a.generate("s", "p", turn2, GREEDY).result()
    one = replace(OPTS, hot_sessions=1)
    long_reply = SamplingSettings(temperature=0, sample_len=900, repeat_penalty=1.0)
    with Engine(str(tiny_model), one, blob_keys=KEYS) as b:
        busy = b.generate("busy", "p", chat(1), long_reply)
        while not b.stats().active_requests:
            time.sleep(0.001)
        info = b.import_session("t", "p", blob)
        assert info.context_tokens > 0
        busy.result()
        got = b.generate("t", "p", turn2, GREEDY).result()
    assert got.usage is not None and expected.usage is not None
    assert got.usage.cached_tokens + got.usage.restored_tokens >= expected.usage.cached_tokens > 0
    assert got.text == expected.text


def test_a_handed_over_session_replaces_only_a_shorter_idle_copy(tiny_model: Path) -> None:
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as a:
        a.generate("s", "p", chat(3), GREEDY).result()
        settle(a)
        long_blob = a.export_session("s", "p")
        a.close_session("s", "p")
        a.generate("s", "p", chat(1), GREEDY).result()
        settle(a)
        short_blob = a.export_session("s", "p")
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as b:
        b.generate("s", "p", chat(1), GREEDY).result()  # a stale copy: a turn that spilled here
        settle(b)
        stale = b.session_info("s", "p").context_tokens
        assert b.adopt_session("s", "p", long_blob)
        longer = b.session_info("s", "p").context_tokens
        assert longer > stale
        assert not b.adopt_session("s", "p", short_blob)  # what is here is longer: it stays
        assert b.session_info("s", "p").context_tokens == longer
        with pytest.raises(NotFound):
            b.adopt_session("s", "someone-else", long_blob)
        assert b.adopt_session("new", "p", short_blob)  # nothing here: imported
        assert b.stats().sessions == 2


def test_damaged_or_foreign_exports_are_refused_and_leave_nothing(tiny_model: Path, tmp_path: Path) -> None:
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as a:
        a.generate("s", "p", chat(2), GREEDY).result()
        settle(a)
        blob = a.export_session("s", "p")
        flipped = bytearray(blob)
        flipped[len(blob) // 2] ^= 0x40
        for bad, err in ((blob[: len(blob) // 2], InvalidArgument), (bytes(flipped), InvalidArgument),
                         (b"garbage", InvalidArgument)):  # fmt: skip
            with pytest.raises(err):
                a.import_session("x", "p", bad)
            assert not a.known("x")
    with Engine(str(other), OPTS, blob_keys=KEYS) as b:
        with pytest.raises(FailedPrecondition, match="another model"):
            b.import_session("x", "p", blob)
        assert not b.known("x") and b.stats().free_sequences == OPTS.hot_sessions


def test_sessions_survive_a_restart_through_the_disk_tier(tiny_model: Path, tmp_path: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4, persist_dir=str(tmp_path))
    turn2 = [*chat(3), M("user", "after the restart")]
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as ref:
        ref.generate("s", "p", chat(3), GREEDY).result()
        settle(ref)
        expected = ref.generate("s", "p", turn2, GREEDY).result()
    with Engine(str(tiny_model), opts, blob_keys=KEYS) as a:
        a.generate("s", "p", chat(3), GREEDY).result()
        settle(a)
    assert len(list(tmp_path.glob("*.session"))) == 1  # snapshotted at shutdown
    store = DiskStore(tmp_path, 1 << 30, model_fingerprint(tiny_model), KEYS)
    assert store.get("s", "mallory") is None  # bound to its principal
    with Engine(str(tiny_model), opts, blob_keys=KEYS) as b:
        got = b.generate("s", "p", turn2, GREEDY).result()
        assert b.stats().disk_restores == 1
    assert got.usage is not None and expected.usage is not None
    assert got.usage.restored_tokens == expected.usage.cached_tokens > 0
    assert got.text == expected.text


def test_a_damaged_file_is_a_cache_miss(tiny_model: Path, tmp_path: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4, persist_dir=str(tmp_path))
    with Engine(str(tiny_model), opts, blob_keys=KEYS) as a:
        first = a.generate("s", "p", chat(2), GREEDY).result()
        settle(a)
    (f,) = tmp_path.glob("*.session")
    f.write_bytes(f.read_bytes()[:-100])
    with Engine(str(tiny_model), opts, blob_keys=KEYS) as b:
        again = b.generate("s", "p", chat(2), GREEDY).result()
    assert again.usage is not None and again.usage.restored_tokens == 0 and again.text == first.text
    rewritten = DiskStore(tmp_path, 1 << 30, model_fingerprint(tiny_model), KEYS).get("s", "p")
    assert rewritten is not None  # rewritten whole


def test_ram_overflow_spills_to_disk_and_clear_deletes_it(tiny_model: Path, tmp_path: Path) -> None:
    opts = EngineOptions(
        context_tokens=4096, session_context_tokens=1024, hot_sessions=1, evicted_bytes=0, persist_dir=str(tmp_path)
    )
    with Engine(str(tiny_model), opts, blob_keys=KEYS) as e:
        e.generate("a", "p", chat(2), GREEDY).result()
        settle(e)
        e.generate("b", "p", chat(1), GREEDY).result()  # "a" leaves the only sequence; RAM holds nothing
        settle(e)
        deadline = time.monotonic() + 5
        while not list(tmp_path.glob("*.session")) and time.monotonic() < deadline:
            time.sleep(0.01)
        again = e.generate("a", "p", [*chat(2), M("user", "x")], GREEDY).result()
        assert again.usage is not None and again.usage.restored_tokens > 0
        e.clear_cache("a", "p")
        e.close_session("b", "p")
        settle(e)
    # Closing the engine waited for its disk writer, and wrote nothing: "a" holds no cache
    # after its clear, "b" is gone. Both files were deleted, whatever their order.
    assert list(tmp_path.glob("*.session")) == []
