"""Attaching to a running server's Ray cluster from another process (``apply``, ``status``).

The CLI joins the cluster as a second driver and talks to Serve's controller; replicas are
reached through the deployment's own handle, steered to one rank at a time by a routing key
that rank owns (the affinity router sends a keyed request to the key's owner only), so what
comes back is that replica's own view.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hotloop_serve.serve.apply_plan import Live
from hotloop_serve.serve.declarative import state_name
from hotloop_serve.serve.ray_state import use_auth_mode
from hotloop_serve.serve.router import rendezvous_order
from hotloop_serve.serve.session_ids import new_routing_key

SERVE_NAMESPACE = "serve"


def attach(address: str, auth_mode: str | None = None) -> None:
    """Join the cluster at ``address`` and check Serve runs there (``RuntimeError`` if not).

    ``auth_mode`` (recorded by ``run``) is what the cluster was started with; an explicit
    ``RAY_AUTH_MODE`` in the environment wins.
    """
    import ray
    from ray.serve.context import _get_global_client

    use_auth_mode(auth_mode)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the CLI prints its own lines
    if not ray.is_initialized():
        ray.init(address=address, namespace="hotloop", log_to_driver=False, configure_logging=False)
    try:
        _get_global_client()
    except Exception as e:
        raise RuntimeError(f"Ray at {address} runs no Ray Serve (is hotloop-serve running there?): {e}") from e


def serve_details() -> dict[str, Any]:
    from ray.serve.context import _get_global_client

    return dict(_get_global_client().get_serve_details())


def live_state() -> Live:
    """The proxies' fixed options and every app with how it was deployed."""
    import ray
    from ray.serve.context import _get_global_client

    details = serve_details()
    client = _get_global_client()
    configs = ray.get(client._controller.get_app_configs.remote())
    declarative: dict[str, dict[str, Any]] = {}
    imperative: set[str] = set()
    for name, app in details.get("applications", {}).items():
        if state_name(app.get("source", "")).lower() == "declarative" and name in configs:
            declarative[name] = configs[name].model_dump(exclude_unset=True)
        else:
            imperative.add(name)
    grpc, http = details.get("grpc_options") or {}, details.get("http_options") or {}
    return Live(
        grpc_port=grpc.get("port"),
        http_port=http.get("port"),
        http_host=http.get("host"),
        grpc_request_timeout_s=grpc.get("request_timeout_s"),
        declarative=declarative,
        imperative=imperative,
    )


@dataclass
class ReplicaView:
    replica_id: str
    state: str
    rank: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ModelView:
    name: str
    status: str
    target: str
    replicas: list[ReplicaView]


def _target(deployment: dict[str, Any]) -> str:
    config = deployment.get("deployment_config") or {}
    scaling = config.get("autoscaling_config")
    if scaling:
        return f"autoscaling {scaling.get('min_replicas')}..{scaling.get('max_replicas')}"
    return f"{config.get('num_replicas', deployment.get('target_num_replicas'))} replicas"


def _key_for(index: int, ranks: list[str]) -> str:
    while True:
        key = new_routing_key()
        if rendezvous_order(key, ranks)[0] == index:
            return key


STATS_TRIES_PER_REPLICA = 12
"""Steered calls per replica before its stats are reported missing."""


def _collect_stats(handle: Any, ranked: list[ReplicaView], timeout_s: float) -> None:
    """Each replica's ``stats()``, through the handle, steered by a key its rank owns.

    A fresh router may still hash a replica on the rank it started with (a replica that
    joined during a roll is renumbered later): the answer names the rank that gave it, so
    it is filed under that replica, and the next key tries again for the ones missing.
    """
    by_rank = {r.rank: r for r in ranked}
    ranks = [str(r.rank) for r in ranked]
    for _ in range(STATS_TRIES_PER_REPLICA * len(ranked)):
        missing = [i for i, r in enumerate(ranked) if not r.stats]
        if not missing:
            return
        target = ranked[missing[0]]
        try:
            steered = handle.options(session_id=_key_for(missing[0], ranks)) if len(ranks) > 1 else handle
            stats = dict(steered.stats.remote().result(timeout_s=timeout_s))
        except Exception as e:  # not a hotloop deployment, or the replica is busy/gone
            target.error = f"no stats: {type(e).__name__}"
            return
        answered = by_rank.get(stats.get("rank"))
        if answered is not None and not answered.stats:
            answered.stats = stats
    for r in ranked:
        if not r.stats:
            r.error = "no stats: the routers do not reach this rank yet"


def model_views(timeout_s: float = 10.0) -> list[ModelView]:
    """Every app's replicas: id, state, rank, and each running replica's ``stats()``."""
    import ray
    from ray import serve

    views = []
    for name, app in sorted(serve_details().get("applications", {}).items()):
        for dep_name, dep in (app.get("deployments") or {}).items():
            replicas = [ReplicaView(str(r["replica_id"]), state_name(r["state"])) for r in dep.get("replicas", [])]
            actors = {str(r["replica_id"]): r.get("actor_name") for r in dep.get("replicas", [])}
            running = [r for r in replicas if r.state == "RUNNING"]
            for r in running:
                try:
                    actor = ray.get_actor(actors[r.replica_id], namespace=SERVE_NAMESPACE)
                    published = ray.get(actor.record_routing_stats.remote(), timeout=timeout_s) or {}
                    r.rank = int(published["rank"]) if "rank" in published else None
                except Exception as e:
                    r.error = f"rank unknown: {e!r}"
            ranked = [r for r in running if r.rank is not None]
            handle = serve.get_deployment_handle(dep_name, name)
            _collect_stats(handle, ranked, timeout_s)
            views.append(ModelView(name, state_name(app.get("status", "")), _target(dep), replicas))
    return views
