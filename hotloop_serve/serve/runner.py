"""Starting and stopping a local hotloop-serve: a Ray runtime, Serve's gRPC proxy, the apps."""

from __future__ import annotations

import os

from hotloop_serve.config import Config
from hotloop_serve.serve.app import (
    GRPC_SERVICER_FUNCTIONS,
    PROXY_MESSAGE_ENV,
    REPLICA_MESSAGE_ENV,
    proxy_message_limit,
    replica_message_limit,
)
from hotloop_serve.serve.declarative import deploy
from hotloop_serve.serve.probe import wait_until_serving

__all__ = ["RAY_SERVE_ENV", "oversubscribed_cores", "start_server", "stop_server", "wait_until_serving"]

RAY_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_worker_niceness": "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}
"""How Ray runs here, set before it starts (its processes inherit them). On a CPU machine
llama.cpp's threads keep every core busy, and each slice another process takes stalls them
all at their next barrier (even idle, Ray beside an in-process engine costs it tokens/s), so:

- Serve's control loop and metrics export run at 0.5 s and 1 s, not 0.1 s and 100 ms: Ray's
  loops then wake half as often at idle. Failure detection, autoscaling and deploys react up
  to 0.4 s later.
- Ray's worker processes (our replicas among them) run at nice 0, not Ray's 15: at 15 the
  engine yields its cores to every Ray daemon and client that wakes up.
- Serve's proxies reach the replicas over gRPC, not Ray's actor calls: the proxy spends less
  CPU per streamed token, at the same tokens/s. A replica that dies then shows as
  *unavailable*, not dead, so the session router ranks it last for a while (``router.py``) and
  the SDKs retry Ray's "may or may not have been executed" error before any text arrived; the
  replicas' gRPC message limit follows the request limit (``app.REPLICA_MESSAGE_ENV``).

Each was measured against Ray's stock value with ``bench/stack.py`` (figures in
``bench/README.md``). Set in the environment to override (``RAY_SERVE_PROXY_USE_GRPC=0``: Ray's
actor calls); the Helm chart sets the same values (a test checks they agree).
"""


def oversubscribed_cores(config: Config, cores: int) -> str | None:
    """Why ``config``'s replicas would fight over this machine's ``cores``, or None.

    A model whose ``engine.threads`` is 0 decodes with every core the process may use, so with
    more than one replica on a machine (a local server: every replica is here) their llama.cpp
    threads stall each other at every barrier, and together they make far fewer tokens/s than
    one engine alone; at a thread each they make more (``bench/threads.py`` row 3 measures
    both). Not fixed automatically: the thread count is part of the
    replicas' code, so deriving it from the replica count would roll every replica on a scale
    change (``declarative.py``).
    """
    most = sum(m.autoscaling.max_replicas if m.autoscaling else m.replicas for m in config.models)
    unset = [m.name for m in config.models if m.engine.threads == 0]
    if most <= 1 or not unset:
        return None
    share = max(1, cores // most)
    return (
        f"up to {most} replicas share this machine's {cores} cores, and each replica of "
        f"{', '.join(unset)} decodes with all of them (engine.threads: 0): their llama.cpp threads "
        f"will stall each other; set engine.threads to {share} (cores / replicas) for the best total throughput"
    )


def start_server(
    config: Config, address: str | None = None, num_cpus: int | None = None, proxy_location: str | None = None
) -> None:
    """Start (or join, with ``address``) a Ray cluster, Serve with its gRPC proxy, and every model.

    ``proxy_location`` is Serve's (default: a proxy on every node, each pod has its own address);
    ``"HeadOnly"`` where the nodes share one host's ports (a cluster simulated on one machine).

    The models are deployed declaratively (``declarative.py``), as ``hotloop-serve apply``
    later changes them: replica counts and autoscaling bounds then change in place.
    """
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    # Inherited by the proxy Ray starts below (a cluster joined with ``address`` keeps its own).
    os.environ.setdefault(PROXY_MESSAGE_ENV, str(proxy_message_limit(config)))
    os.environ.setdefault(REPLICA_MESSAGE_ENV, str(replica_message_limit(config)))
    for name, value in RAY_SERVE_ENV.items():
        os.environ.setdefault(name, value)
    if not ray.is_initialized():
        ray.init(
            address=address,
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            namespace="hotloop",
        )
    serve.start(
        proxy_location=proxy_location,
        http_options=HTTPOptions(host=config.server.host, port=config.server.http_port),
        grpc_options=gRPCOptions(
            port=config.server.grpc_port,
            grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS,
            request_timeout_s=config.server.request_timeout_s,
        ),
    )
    deploy(config)


def stop_server() -> None:
    """Remove the apps, stop Serve and the Ray runtime this process started."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
