"""Is a hotloop-serve up? The readiness check the CLI uses, and a free port to start one on.

Light on purpose (grpcio and its health stubs only, no Ray, no engine): ``hotloop-serve
start``, the benchmarks and the tests all wait for a server with the same
:func:`wait_until_serving`, and pick ports with the same :func:`free_port`.
"""

from __future__ import annotations

import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process could take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_serving(address: str, models: list[str], timeout_s: float = 300.0) -> None:
    """Block until every model's health check answers SERVING through the proxy.

    Raises ``TimeoutError`` naming the models still not serving after ``timeout_s``.
    """
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
