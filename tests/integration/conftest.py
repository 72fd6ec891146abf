"""One real hotloop-serve for the integration tests: Ray, Serve's gRPC proxy, the Gemma model.

Two applications share the cluster: ``gemma-3-270m`` (one replica) and ``gemma-duo`` (two
replicas, for affinity and failover). Started once per test session on a free loopback
port and stopped at the end.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import free_port
from hotloop_client import Client

from hotloop_serve.config import Config, config_from_dict

SINGLE = "gemma-3-270m"
DUO = "gemma-duo"


@dataclass
class Server:
    address: str
    config: Config


def integration_config(port: int) -> Config:
    engine = {"context_tokens": 16384, "session_context_tokens": 4096, "hot_sessions": 8, "threads": 2}
    return config_from_dict(
        {
            "server": {"grpc_port": port, "http_port": free_port()},
            "telemetry": {"enabled": False},
            "models": [
                {"name": SINGLE, "engine": engine, "resources": {"num_cpus": 1}},
                {"name": DUO, "replicas": 2, "engine": engine, "resources": {"num_cpus": 1}},
            ],
        }
    )


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    from hotloop_serve.serve.runner import start_server, stop_server, wait_until_serving

    port = free_port()
    config = integration_config(port)
    address = f"127.0.0.1:{port}"
    # gemma-duo runs two replicas: a deployment of several needs a session secret (app.session_secret).
    os.environ.setdefault("HOTLOOP_SESSION_SECRET", secrets.token_urlsafe(32))
    try:
        start_server(config, num_cpus=8)
        wait_until_serving(address, [m.name for m in config.models], timeout_s=300)
        yield Server(address, config)
    finally:
        stop_server()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.address) as c:
        yield c
