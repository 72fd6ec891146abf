"""Autoscaling with direct ingress: Ray's default policy, with the replicas' direct calls in
flight counted as ongoing requests (``serve/autoscaling.py``), and the deployment options that
pick it."""

from __future__ import annotations

import math
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config, replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from hotloop_serve.config import config_from_dict
from hotloop_serve.serve.app import deployment_options
from hotloop_serve.serve.autoscaling import (
    DIRECT_ONGOING_METRIC,
    POLICY,
    direct_aware_policy,
    direct_ongoing,
    with_direct_streams,
)
from hotloop_serve.serve.declarative import fleet_options

DEPLOYMENT = DeploymentID(name="m", app_name="m")


def replica(n: int) -> ReplicaID:
    return ReplicaID(unique_id=f"r{n}", deployment_id=DEPLOYMENT)


def context(
    ongoing: float,
    direct: dict[int, float] | None,
    running: int = 2,
    target: float = 4.0,
    policy_state: dict[str, Any] | None = None,
    **scaling: Any,
) -> AutoscalingContext:
    """What Serve's controller hands a policy: ``ongoing`` requests Ray counted, and each
    replica's reported direct calls (already reduced over the look-back window)."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=10, target_ongoing_requests=target, **scaling)
    metrics = {DIRECT_ONGOING_METRIC: {replica(r): v for r, v in direct.items()}} if direct is not None else {}
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name="m",
        app_name="m",
        current_num_replicas=running,
        target_num_replicas=running,
        running_replicas=[replica(r) for r in range(running)],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=10,
        policy_state=policy_state if policy_state is not None else {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


@pytest.mark.parametrize(
    ("ongoing", "direct", "desired"),
    [
        (0.0, {0: 12.0, 1: 12.0}, 6.0),  # only direct streams: 24 / 4 per replica = 6 replicas
        (8.0, {0: 12.0, 1: 4.0}, 6.0),  # Ray's 8 + direct 16 = 24
        (8.0, {}, 2.0),  # direct ingress idle: Ray's count alone
        (8.0, None, 2.0),  # no replica reported yet (or direct ingress off)
        (2.0, {0: 1.0, 1: 1.0}, 1.0),  # 4 in all: below the target, one replica would do
    ],
)
def test_ongoing_requests_are_ray_s_plus_the_direct_calls(
    ongoing: float, direct: dict[int, float] | None, desired: float
) -> None:
    ctx = context(ongoing, direct)
    assert with_direct_streams(ctx).total_num_requests == ongoing + sum((direct or {}).values())
    decision, _ = direct_aware_policy(ctx)
    assert decision == pytest.approx(desired)
    # ... which is Ray's default policy's own answer for that many ongoing requests.
    expected, _ = replica_queue_length_autoscaling_policy(context(ongoing + sum((direct or {}).values()), None))
    assert decision == pytest.approx(expected)


def test_a_replica_no_longer_running_is_not_counted() -> None:
    ctx = context(0.0, {0: 4.0, 1: 4.0, 7: 100.0})  # r7 stopped; its last report lingers
    assert direct_ongoing(ctx) == 8.0


def test_the_context_is_otherwise_ray_s_own() -> None:
    state = {"kept": 1}
    ctx = context(3.0, {0: 1.0}, policy_state=state)
    wrapped = with_direct_streams(ctx)
    assert wrapped.policy_state is state and wrapped.config is ctx.config
    assert wrapped.running_replicas == ctx.running_replicas and wrapped.total_queued_requests == 0.0
    assert wrapped.aggregated_metrics == ctx.aggregated_metrics
    assert ctx.total_num_requests == 3.0  # the original is left as Serve made it


def test_serve_s_wrapping_applies_delays_factors_and_bounds_to_the_sum() -> None:
    """Through the wrapper Serve puts around every policy, default or custom: the direct-aware
    decision is the default policy's at the summed load, delays and all."""
    up = _apply_autoscaling_config(direct_aware_policy)
    ray_default = _apply_autoscaling_config(replica_queue_length_autoscaling_policy)
    ours, _ = up(context(0.0, {0: 20.0, 1: 20.0}, upscale_delay_s=0.0))
    theirs, _ = ray_default(context(40.0, None, upscale_delay_s=0.0))
    assert ours == theirs == math.ceil(40 / 4)
    # With an upscale delay, neither scales on the first tick.
    held, state = up(context(0.0, {0: 20.0, 1: 20.0}, upscale_delay_s=30.0))
    assert held == 2 and state


def test_the_direct_aware_policy_is_chosen_only_with_direct_ingress_and_autoscaling() -> None:
    def cfg(direct: bool, autoscaling: dict[str, Any] | None) -> Any:
        return config_from_dict(
            {"server": {"direct_ingress": direct}, "models": [{"name": "m", "autoscaling": autoscaling}]}
        ).models[0]

    scaled = deployment_options(cfg(True, {}), direct=True)["autoscaling_config"]
    assert scaled.policy.policy_function == POLICY
    assert deployment_options(cfg(False, {}))["autoscaling_config"].policy.is_default_policy_function()
    assert "autoscaling_config" not in deployment_options(cfg(True, None), direct=True)
    # The declarative document names the same path (Serve hashes it into the code version).
    assert fleet_options(cfg(True, {}), direct=True)["autoscaling_config"]["policy"] == {"policy_function": POLICY}
    assert "policy" not in fleet_options(cfg(False, {}))["autoscaling_config"]
    assert fleet_options(cfg(True, None), direct=True)["autoscaling_config"] is None
