"""Autoscaling that sees direct-ingress streams: Ray's default policy over ongoing requests
plus the replicas' direct calls in flight.

Ray Serve scales a deployment on its ongoing requests, which it counts where requests pass
through Ray (the proxy's handles, the replicas' request slots). A turn sent to a replica's own
gRPC server (``server.direct_ingress``, ``direct_ingress.py``) never does, so a fleet serving
mostly ``direct=True`` clients looked idle to the autoscaler. Each replica therefore reports its
direct calls in flight through Ray's ``record_autoscaling_stats`` hook
(``ModelReplica.record_autoscaling_stats``, metric :data:`DIRECT_ONGOING_METRIC`), Ray averages
each replica's series over ``look_back_period_s`` like its own count, and
:func:`direct_aware_policy` hands Ray's own default policy a context whose ongoing requests are
Ray's plus the direct ones. Everything else (the target per replica, upscale/downscale delays,
scaling factors, bounds, the cold start from zero) stays Ray's: Serve wraps a custom policy in
the same defaults as its built-in one (``autoscaling_policy._apply_autoscaling_config``).

Serve pickles this module by value into its controller (``AutoscalingPolicy.serialize_policy``)
and hashes the policy's import path into the application's code version; so it imports nothing
of hotloop_serve, and the path :data:`POLICY` is only set where direct ingress is on (a server
without it keeps Ray's default policy and its code version).
"""

from __future__ import annotations

from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

DIRECT_ONGOING_METRIC = "hotloop_direct_ongoing_requests"
"""The custom autoscaling metric a replica reports: its direct-ingress calls in flight."""
POLICY = "hotloop_serve.serve.autoscaling:direct_aware_policy"
"""Import path of :func:`direct_aware_policy` (``AutoscalingConfig.policy.policy_function``)."""


def direct_ongoing(ctx: AutoscalingContext) -> float:
    """The direct calls in flight over the running replicas, each replica's series reduced over
    the look-back window by the deployment's aggregation function (as Ray reduces its own);
    0 when no replica reported (direct ingress off, or the first reports not in yet)."""
    per_replica = (ctx.aggregated_metrics or {}).get(DIRECT_ONGOING_METRIC) or {}
    running = set(ctx.running_replicas)
    return float(sum(value for replica, value in per_replica.items() if replica in running))


def with_direct_streams(ctx: AutoscalingContext) -> AutoscalingContext:
    """``ctx`` with ``total_num_requests`` = Ray's ongoing requests + :func:`direct_ongoing`.

    A new context (the public constructor) rather than a patched one: its metrics are lazy
    cached properties, and Serve may read the original's afterwards (its gauges, its log)."""
    return AutoscalingContext(
        deployment_id=ctx.deployment_id,
        deployment_name=ctx.deployment_name,
        app_name=ctx.app_name,
        current_num_replicas=ctx.current_num_replicas,
        target_num_replicas=ctx.target_num_replicas,
        running_replicas=ctx.running_replicas,
        total_num_requests=lambda: ctx.total_num_requests + direct_ongoing(ctx),
        total_queued_requests=lambda: ctx.total_queued_requests,
        aggregated_metrics=lambda: ctx.aggregated_metrics,
        raw_metrics=lambda: ctx.raw_metrics,
        capacity_adjusted_min_replicas=ctx.capacity_adjusted_min_replicas,
        capacity_adjusted_max_replicas=ctx.capacity_adjusted_max_replicas,
        policy_state=ctx.policy_state,
        last_scale_up_time=ctx.last_scale_up_time,
        last_scale_down_time=ctx.last_scale_down_time,
        current_time=ctx.current_time,
        config=ctx.config,
    )


def direct_aware_policy(ctx: AutoscalingContext) -> tuple[int | float, dict[str, Any]]:
    """Ray's default policy (``replica_queue_length_autoscaling_policy``) counting direct calls
    as ongoing requests: desired replicas = running x (Ray's ongoing + direct) / (target x running)."""
    desired, state = replica_queue_length_autoscaling_policy(with_direct_streams(ctx))
    return desired, state
