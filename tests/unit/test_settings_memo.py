"""The runner-up's memory of other replicas' session settings: bounded, and only for their principal."""

from __future__ import annotations

from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.serve.settings_memo import SettingsMemo


def test_remembers_for_the_principal_that_set_them_only() -> None:
    memo = SettingsMemo()
    memo.set("s1", "alice", SamplingSettings(sample_len=3))
    got = memo.get("s1", "alice")
    assert got is not None and got.sample_len == 3
    assert memo.get("s1", "mallory") is None
    assert memo.get("s2", "alice") is None


def test_a_change_replaces_and_a_close_forgets() -> None:
    memo = SettingsMemo()
    memo.set("s1", "alice", SamplingSettings(sample_len=3))
    memo.set("s1", "alice", SamplingSettings(sample_len=5))
    got = memo.get("s1", "alice")
    assert got is not None and got.sample_len == 5 and len(memo) == 1
    memo.set("s1", "alice", None)
    assert memo.get("s1", "alice") is None and len(memo) == 0 and memo.bytes == 0


def test_bounded_in_bytes_least_recently_set_first_out() -> None:
    schema = '{"type": "string", "description": "' + "x" * 10_000 + '"}'  # counted by its size
    memo = SettingsMemo(budget_bytes=35_000)
    for i in range(5):
        memo.set(f"s{i}", "alice", SamplingSettings(json_schema=schema))
    assert len(memo) == 3 and memo.bytes <= 35_000
    assert memo.get("s0", "alice") is None and memo.get("s1", "alice") is None
    assert memo.get("s4", "alice") is not None
    memo.set("s2", "alice", SamplingSettings(json_schema=schema))  # set again: now the newest
    memo.set("s5", "alice", SamplingSettings(json_schema=schema))
    assert memo.get("s2", "alice") is not None and memo.get("s3", "alice") is None
