"""Starting and stopping a local hotloop-serve: a Ray runtime, Serve's gRPC proxy, the apps."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hotloop_serve.config import Config
from hotloop_serve.serve.app import GRPC_SERVICER_FUNCTIONS, deploy


def start_server(config: Config, address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or join, with ``address``) a Ray cluster, Serve with its gRPC proxy, and every model."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

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


def wait_until_serving(address: str, models: list[str], timeout_s: float = 300.0) -> None:
    """Block until every model's health check answers SERVING through the proxy."""
    deadline = time.monotonic() + timeout_s
    pending = list(models)
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while pending:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), metadata=[("application", pending[0])], timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    pending.pop(0)
                    continue
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"models not serving after {timeout_s:.0f} s: {pending}")
            time.sleep(0.5)
