"""The live server a chaos soak runs against, and the faults it can inflict on it.

A real ``hotloop-serve run`` in its own process group (``harness.ManagedProcess``), with its
own ``HOTLOOP_HOME`` (so ``hotloop-serve apply`` finds this server's Ray cluster and no one
else's) and a fixed session secret (so session ids, exported blobs and the disk tier stay
valid across a whole-server restart). Every fault is something an operator or the machine
really does: SIGKILL of a replica's process, ``hotloop-serve apply`` to scale or roll, SIGINT
of the server and a fresh start on the same ports and ``persist_dir``. Nothing is mocked.
"""

from __future__ import annotations

import copy
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HOTLOOP_CLI, ManagedProcess

from hotloop_serve.serve.probe import free_port, wait_until_serving

MODEL = "chaos-gemma"
"""The soak's model name: replica processes are found by it (``ServeReplica:chaos-gemma:``),
so another hotloop-serve on the machine (the test suite's) is never touched."""

READY_TIMEOUT_S = 300.0


@dataclass
class ReplicaSample:
    pid: int
    rss: int
    fds: int


@dataclass
class ChaosServer:
    """One hotloop-serve process tree, restartable, changed in place with ``apply``."""

    workdir: Path
    engine: dict[str, Any]
    replicas: int = 2
    limits: dict[str, Any] = field(default_factory=dict)
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    starts: int = 0
    _proc: ManagedProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/{MODEL}/v1"

    @property
    def persist_dir(self) -> Path:
        return Path(self.engine["persist_dir"])

    def config(self, replicas: int | None = None, **engine: Any) -> dict[str, Any]:
        model: dict[str, Any] = {
            "name": MODEL,
            "replicas": self.replicas if replicas is None else replicas,
            # Half a CPU each: scaled to 3 replicas, the soak's fleet still fits Ray's 2 CPUs here
            # (each replica runs one llama.cpp thread: engine.threads).
            "resources": {"num_cpus": 0.5},
            "engine": {**copy.deepcopy(self.engine), **engine},
        }
        if self.limits:
            model["limits"] = dict(self.limits)
        return {
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port},
            "telemetry": {"enabled": False},
            "models": [model],
        }

    def _env(self) -> dict[str, str]:
        return {**os.environ, "HOTLOOP_HOME": str(self.workdir / "home"), "HOTLOOP_SESSION_SECRET": self.secret}

    def _write(self, name: str, config: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> float:
        """Start the server and wait until the model serves; returns the seconds it took."""
        t0 = time.monotonic()
        (self.workdir / "home").mkdir(parents=True, exist_ok=True)
        config = self._write("config.yaml", self.config())
        self.starts += 1
        log = self.workdir / f"server-{self.starts}.log"
        self._proc = ManagedProcess([str(HOTLOOP_CLI), "run", "--config", str(config)], log, env=self._env())
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self._proc.alive():
                raise RuntimeError(f"hotloop-serve exited early:\n{self._proc.log_tail()}")
            try:
                wait_until_serving(self.address, [MODEL], timeout_s=5)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not serving after {READY_TIMEOUT_S:.0f} s") from None
        self._proc.remember_tree()
        return time.monotonic() - t0

    def stop(self) -> float:
        """SIGINT (the graceful path: in-flight turns finish, sessions go to the disk tier)."""
        t0 = time.monotonic()
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        return time.monotonic() - t0

    def log_tail(self) -> str:
        return self._proc.log_tail() if self._proc is not None else ""

    # -- faults ------------------------------------------------------------------------

    def replica_processes(self) -> list[psutil.Process]:
        """This model's replica actors (Ray names their processes ``ray::ServeReplica:<app>:...``)."""
        out = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info.get("cmdline") or ())
            if f"ServeReplica:{MODEL}:" in cmd:
                out.append(p)
        return out

    def kill_replica(self, rng: random.Random) -> str:
        """SIGKILL one replica's process, as the OOM killer or a lost VM would."""
        victims = self.replica_processes()
        if not victims:
            return "no replica process found"
        victim = rng.choice(victims)
        os.kill(victim.pid, signal.SIGKILL)
        return f"SIGKILL pid {victim.pid} of {len(victims)}"

    def apply(self, replicas: int | None = None, **engine: Any) -> str:
        """``hotloop-serve apply`` with a changed config; raises if it did not converge."""
        if replicas is not None:
            self.replicas = replicas
        self.engine.update(engine)
        path = self._write(f"apply-{time.monotonic_ns()}.yaml", self.config())
        done = subprocess.run(
            [str(HOTLOOP_CLI), "apply", "--config", str(path), "--timeout", "300"],
            capture_output=True,
            check=False,
            text=True,
            env=self._env(),
            timeout=400,
        )
        if done.returncode != 0:
            raise RuntimeError(f"apply failed ({done.returncode}): {done.stdout[-1500:]} {done.stderr[-1500:]}")
        lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
        return "; ".join(lines[-2:])

    def restart(self) -> str:
        stopped = self.stop()
        started = self.start()
        return f"stopped in {stopped:.1f} s, serving again in {started:.1f} s"

    # -- resources ---------------------------------------------------------------------

    def sample_replicas(self) -> list[ReplicaSample]:
        out = []
        for p in self.replica_processes():
            try:
                out.append(ReplicaSample(p.pid, p.memory_info().rss, p.num_fds()))
            except psutil.Error:
                continue
        return out

    def disk_bytes(self) -> int:
        total = 0
        for root, _dirs, files in os.walk(self.persist_dir):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    continue
        return total
