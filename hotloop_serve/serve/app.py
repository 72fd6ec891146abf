"""Building the Ray Serve applications from the config: one application per model.

Each model is its own application, named after the model, whose ingress is the model's
deployment; clients pick it with the ``application`` gRPC metadata (the SDKs do). Over HTTP the
same deployment answers the OpenAI-compatible API under the route prefix ``/<model>``
(``openai_http.py``). The same
``build_app`` is the import path of the Serve config that KubeRay deploys (``serve_config``
renders it; the Helm chart renders the same document).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.deployment import Application

from hotloop_serve.config import Config, ModelConfig, config_from_dict
from hotloop_serve.serve.auth import describe_tokens, export_secrets, load_tokens
from hotloop_serve.serve.autoscaling import POLICY
from hotloop_serve.serve.deployment import ModelDeployment
from hotloop_serve.serve.servicer import HEALTH_WATCHES

GRPC_SERVICER_FUNCTIONS = [
    "hotloop.v1.session_pb2_grpc.add_SessionServiceServicer_to_server",
    "hotloop.v1.model_pb2_grpc.add_ModelServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
BUILDER_IMPORT_PATH = "hotloop_serve.serve.app:build_app"


def session_secret(config: Config) -> str:
    """The key signing session ids, shared by all replicas: from the environment, else fresh.

    A fresh key changes every session id at each deploy (a config change, a restart), and a
    deployment of several replicas is one that gets redeployed under live sessions: there, no
    key is refused with a ``ValueError`` saying how to set one.
    """
    name = config.auth.session_secret_env
    secret = os.environ.get(name) if name else None
    if secret:
        return secret
    several = [m.name for m in config.models if m.autoscaling or m.replicas > 1]
    if several:
        where = f"the environment variable {name}" if name else "auth.session_secret_env and that variable"
        raise ValueError(
            f"{', '.join(several)}: several replicas (or autoscaling) need one session secret that survives "
            f"redeploys; set {where}, e.g. "
            "export HOTLOOP_SESSION_SECRET=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secrets.token_urlsafe(32)


def preflight(config: Config) -> list[str]:
    """What would make the replicas refuse to start, checked before deploying (``ValueError``
    with the reason); returns start-up facts worth printing (how auth is set up)."""
    export_secrets(config.auth, session_secret(config))
    return [describe_tokens(load_tokens(config.auth), config.auth.anonymous)]


PROXY_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
"""Ray Serve's gRPC proxy reads its maximum message size from this variable (default 2 GiB),
once, when it starts."""
PROXY_MESSAGE_SLACK = 64 * 1024
"""Above the largest ``limits.max_request_bytes``, so the replica, not the proxy, names the limit."""


def proxy_message_limit(config: Config) -> int:
    """The largest message Ray's gRPC proxy should take: the largest request any model accepts
    (``limits.max_request_bytes``) plus :data:`PROXY_MESSAGE_SLACK`. A request beyond it is
    refused by the proxy itself (RESOURCE_EXHAUSTED) instead of being pickled to a replica."""
    return max(m.limits.max_request_bytes for m in config.models) + PROXY_MESSAGE_SLACK


REPLICA_MESSAGE_ENV = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
"""With the proxy reaching replicas over gRPC (``runner.RAY_SERVE_ENV``), the largest message a
replica's gRPC server takes and a proxy takes back; Ray's default is 4 MiB, below a 4 MiB
request in its envelope. Read once, when each Ray process starts."""


def replica_message_limit(config: Config) -> int:
    """The proxy's limit plus the envelope a request travels in to the replica (pickled
    request metadata and arguments): :data:`PROXY_MESSAGE_SLACK` again."""
    return proxy_message_limit(config) + PROXY_MESSAGE_SLACK


CONTROL_HEADROOM = 4
"""Request slots of a replica kept for control RPCs (GetSession, ClearCache, CloseSession,
UpdateSettings...) above its model work, so long streams never starve them."""


def max_ongoing_requests(model: ModelConfig) -> int:
    """Requests one replica takes at once (Ray Serve's ``max_ongoing_requests``).

    Model work (Generate, Warmup) is bounded by the engine itself: ``hot_sessions`` decode
    together, ``max_queue`` more wait, and the next is refused with RESOURCE_EXHAUSTED. The
    replica's slots cover all of that plus :data:`CONTROL_HEADROOM` and the health Watch
    streams (``servicer.HEALTH_WATCHES``), so a session's control RPCs and health checks
    always find a slot on the session's owner, and the router never has to send them to a
    replica that does not hold the session. ``routing.max_ongoing_requests`` overrides it.
    """
    engine = model.engine
    return model.routing.max_ongoing_requests or (
        engine.hot_sessions + engine.max_queue + CONTROL_HEADROOM + HEALTH_WATCHES
    )


ROUTING_STATS_PERIOD_S = 1.0
"""How often each replica's rank is polled for the routers (``record_routing_stats``)."""


def deployment_options(model: ModelConfig, direct: bool = False) -> dict[str, Any]:
    """Ray Serve options for a model's deployment, from its config; ``direct``
    (``server.direct_ingress``) makes autoscaling count direct streams (``autoscaling.py``)."""
    max_ongoing = max_ongoing_requests(model)
    actor: dict[str, Any] = {"num_cpus": model.resources.num_cpus, "num_gpus": model.resources.num_gpus}
    if model.resources.memory_bytes:
        actor["memory"] = model.resources.memory_bytes
    if model.env:
        actor["runtime_env"] = {"env_vars": dict(model.env)}
    opts: dict[str, Any] = {
        "name": model.name,
        "ray_actor_options": actor,
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": model.engine.max_queue,
        "graceful_shutdown_timeout_s": model.graceful_shutdown_timeout_s,
        "health_check_period_s": 5,
    }
    if model.autoscaling:
        a = model.autoscaling
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            initial_replicas=max(a.min_replicas, 1),
            target_ongoing_requests=a.target_ongoing_requests,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
            look_back_period_s=a.look_back_period_s,
            **({"policy": AutoscalingPolicy(policy_function=POLICY)} if direct else {}),
        )
    else:
        opts["num_replicas"] = model.replicas
    if model.routing.session_affinity:
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="hotloop_serve.serve.router:SessionAffinityRouter",
            # Routers learn a rank Ray renumbered from these stats: a short period keeps the
            # window in which they hash on another rank than the replicas short (Ray: 10 s).
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    return opts


def model_app(config: Config, model: ModelConfig, secret: str) -> Application:
    options = deployment_options(model, config.server.direct_ingress)
    return ModelDeployment.options(**options).bind(config.model_dump(mode="json"), model.name, secret)


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve application builder: ``args = {"config": <hotloop config>, "model": <name>}``."""
    config = config_from_dict(args["config"])
    return model_app(config, config.model(args["model"]), session_secret(config))


def serve_config(config: Config) -> dict[str, Any]:
    """The Serve config document (KubeRay's serveConfigV2) deploying ``config``."""
    doc = config.model_dump(mode="json")
    grpc_options: dict[str, Any] = {"port": config.server.grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS}
    if config.server.request_timeout_s is not None:
        grpc_options["request_timeout_s"] = config.server.request_timeout_s
    return {
        "http_options": {"host": "0.0.0.0", "port": config.server.http_port},
        "grpc_options": grpc_options,
        "applications": [
            {
                "name": m.name,
                "route_prefix": f"/{m.name}",
                "import_path": BUILDER_IMPORT_PATH,
                "args": {"config": doc, "model": m.name},
            }
            for m in config.models
        ],
    }
