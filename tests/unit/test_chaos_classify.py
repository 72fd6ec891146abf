"""The chaos soak's client tells documented "retry later" answers from violations (bench/chaos_clients.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from hotloop_client import _base

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import chaos_clients


def test_ray_s_application_not_found_while_a_server_restarts_is_retried_not_a_violation() -> None:
    # Seen in CI: after the SDK's own retries ran out during a whole-server restart.
    ray = "Application 'chaos-gemma' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available ..."
    assert chaos_clients.grpc_retry_cause("NOT_FOUND", ray) is not None
    assert chaos_clients.RAY_APP_NOT_FOUND == _base._APP_NOT_FOUND  # the SDKs retry the same wording


def test_our_own_not_found_and_internal_stay_violations() -> None:
    assert chaos_clients.grpc_retry_cause("NOT_FOUND", "session 'abc' not found") is None
    assert chaos_clients.grpc_retry_cause("INTERNAL", "boom") is None
    assert chaos_clients.grpc_retry_cause("UNAVAILABLE", "") == "UNAVAILABLE"
