"""One real hotloop-serve for the integration tests: Ray, Serve's gRPC proxy, the Gemma model.

Two applications share the cluster: ``gemma-3-270m`` (one replica) and ``gemma-duo`` (two
replicas, for affinity and failover). Started once per test session on a free loopback
port and stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import free_port
from hotloop_client import Client, Message, Role, Settings

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
                {
                    "name": SINGLE,
                    "engine": engine,
                    "resources": {"num_cpus": 1},
                    # Bounds the untrusted-input suite reaches in seconds (test_untrusted_input.py).
                    "limits": {
                        "sessions_per_principal": 100,
                        "import_bytes_per_principal": 16 << 20,
                        "import_bytes_per_replica": 64 << 20,
                    },
                },
                {"name": DUO, "replicas": 2, "engine": engine, "resources": {"num_cpus": 1}},
            ],
        }
    )


def wait_until_every_replica_serves(
    address: str, model: str, replicas: int, timeout_s: float, token: str | None = None
) -> None:
    """Block until each of ``model``'s replicas both owns a new session and serves its turn.

    The health check proves one replica answers; right after start the proxy's router may not
    know the others yet, or may find one too busy finishing its start to take a turn (Generate
    then spills to the next-ranked replica). Tests of routing need the whole fleet routable.
    """
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    with Client(address, token=token) as c:
        m = c.model(model)
        while len(seen) < replicas:
            if time.monotonic() > deadline:
                served = f"only ranks {sorted(seen)} of {replicas} served a turn"
                raise TimeoutError(f"{model}: {served} in {timeout_s:.0f} s")
            with m.new_session(settings=Settings(temperature=0, sample_len=1)) as s:
                final = list(s.generate([Message(Role.USER, "Hi")]))[-1]
                owner = s.info().served_by
                assert final.served_by is not None and owner is not None
                if final.served_by.replica_rank == owner.replica_rank:
                    seen.add(owner.replica_rank)
                else:
                    time.sleep(0.5)


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
        wait_until_every_replica_serves(address, DUO, replicas=2, timeout_s=180)
        yield Server(address, config)
    finally:
        stop_server()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.address) as c:
        yield c


@contextlib.contextmanager
def synthetic_app(
    server: Server,
    name: str,
    engine: dict[str, Any],
    model: dict[str, Any],
    server_options: dict[str, Any] | None = None,
) -> Iterator[Server]:
    """A synthetic-engine application ``name`` on the shared server, deployed for the block
    (``model``: the model entry's other fields, ``server_options``: ``server.*`` overrides)."""
    from ray import serve

    from hotloop_serve.serve.app import model_app

    doc = server.config.model_dump(mode="json")
    doc["server"].update(server_options or {})
    doc["models"] = [{"name": name, "engine": {"kind": "synthetic", **engine}, **model}]
    config = config_from_dict(doc)
    app = model_app(config, config.models[0], os.environ["HOTLOOP_SESSION_SECRET"])
    serve.run(app, name=name, route_prefix=f"/{name}")
    try:
        yield Server(server.address, config)
    finally:
        if serve.status().applications.get(name) is not None:
            serve.delete(name)
