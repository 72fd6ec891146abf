"""Starting and stopping a local hotloop-serve: a Ray runtime, Serve's gRPC proxy, the apps."""

from __future__ import annotations

import os

from hotloop_serve.config import Config
from hotloop_serve.serve.app import GRPC_SERVICER_FUNCTIONS, PROXY_MESSAGE_ENV, proxy_message_limit
from hotloop_serve.serve.declarative import deploy
from hotloop_serve.serve.probe import wait_until_serving

__all__ = ["start_server", "stop_server", "wait_until_serving"]


def start_server(config: Config, address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join, with ``address``) a Ray cluster, Serve with its gRPC proxy, and every model.

    The models are deployed declaratively (``declarative.py``), as ``hotloop-serve apply``
    later changes them: replica counts and autoscaling bounds then change in place.
    """
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    # Inherited by the proxy Ray starts below (a cluster joined with ``address`` keeps its own).
    os.environ.setdefault(PROXY_MESSAGE_ENV, str(proxy_message_limit(config)))
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
