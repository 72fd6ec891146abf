"""The CLI's bookkeeping for a running server (no Ray needed): the recorded address and auth
mode, and the status view's hit rate."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hotloop_serve.cli.status_view import hit_rate
from hotloop_serve.serve.ray_state import AUTH_MODE_ENV, STATE_FILE, recorded, use_auth_mode


def test_recorded_address_is_forgotten_with_its_process(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    state.write_text(json.dumps({"address": "10.0.0.1:6379", "pid": os.getpid(), "auth_mode": "token"}))
    assert recorded(tmp_path) == ("10.0.0.1:6379", "token")
    state.write_text(json.dumps({"address": "10.0.0.1:6379", "pid": 2**22 + 12345, "auth_mode": None}))
    assert recorded(tmp_path) is None and not state.exists()  # a dead server's record is removed
    assert recorded(tmp_path) is None


def test_the_recorded_auth_mode_is_used_unless_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_MODE_ENV, raising=False)
    use_auth_mode(None)
    assert AUTH_MODE_ENV not in os.environ
    monkeypatch.setenv(AUTH_MODE_ENV, "disabled")
    use_auth_mode("token")
    assert os.environ[AUTH_MODE_ENV] == "disabled"  # the user's explicit choice wins


def test_hit_rate_counts_hot_and_restored_prompt_tokens() -> None:
    assert hit_rate({}) is None
    assert hit_rate({"prompt_tokens": 200, "cached_tokens": 150, "restored_tokens": 30}) == 0.9
