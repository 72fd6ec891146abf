"""The benchmark harness: servers as subprocesses, sessions played concurrently, measured.

Reusable by every benchmark that runs a real server (``peer.py``, ``affinity.py``): a
``Server`` is started (``ManagedProcess``: own session, SIGINT then SIGKILL, every descendant
reaped), warmed up, driven with every session of a ``workload.Workload`` at once
(``run_system``), its process tree's RSS and CPU sampled (``RssSampler``, with a memory guard),
and summarized per system (``summarize``). ``HotloopServer`` is hotloop-serve's own server;
the peer's lives in ``peer.py``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

# bench/ is a folder of scripts, not a package: make ``workload`` importable however this
# file is launched (``python bench/x.py`` already has bench/ on sys.path; ``-m`` has not).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import SessionScript, Turn, Workload, WorkloadSpec, build_workload, describe

from hotloop_serve.serve.probe import free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
HOTLOOP_CLI = REPO / ".venv" / "bin" / "hotloop-serve"
MODEL_NAME = "gemma-3-270m"

GiB = 1024**3
READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 60.0
REQUEST_TIMEOUT_S = 3600.0
"""Per-request socket/RPC deadline: the peer serializes requests, so one may wait minutes."""
MEMORY_FLOOR = int(1.5 * GiB)
"""If the machine's available memory drops below this during a run, the server under test is
killed: other people's jobs share this machine, and an OOM kill would hit them too."""


# ---------------------------------------------------------------------------------------
# What one turn measured
# ---------------------------------------------------------------------------------------


@dataclass
class Reply:
    """What a backend reports once a streamed reply has ended (hotloop fields are None elsewhere)."""

    tokens: int = 0
    finish: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """hotloop only: prompt tokens reused from the session's hot cache."""
    prefilled_tokens: int | None = None
    replica: str | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    """hotloop only: the server's own timings of this request."""


@dataclass
class TurnRecord:
    """One request as the client saw it (times are seconds from the start of the run) and what
    the backend reported of it (``reply``)."""

    session: int
    turn: int
    start_s: float
    ttft_s: float | None = None
    """Request sent -> first non-empty text delta."""
    decode_s: float | None = None
    """First -> last non-empty text delta."""
    end_s: float | None = None
    """Stream finished (the server may still do work after the last token, e.g. cache saves)."""
    reply: Reply = field(default_factory=Reply)
    error: str | None = None
    text: str = field(default="", repr=False)


class Conversation(Protocol):
    """One chat session on a server under test."""

    def stream(self, history: Sequence[Turn]) -> Iterator[str]:
        """Send the whole history; yield text deltas as they arrive; then ``last`` is set."""
        ...

    @property
    def last(self) -> Reply: ...

    def close(self) -> None: ...


class Server(Protocol):
    """A server under test: started, talked to, measured and stopped by ``run_system``."""

    key: str
    label: str
    config: dict[str, Any]

    def start(self, log_path: Path) -> None: ...

    @property
    def pid(self) -> int: ...

    @property
    def process(self) -> ManagedProcess: ...

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation: ...

    def stop(self) -> None: ...

    def notes(self) -> dict[str, Any]:
        """Server-side facts worth reporting (read from its log after the run)."""
        ...


# ---------------------------------------------------------------------------------------
# Process handling shared by both servers
# ---------------------------------------------------------------------------------------


def wait_http_ready(proc: ManagedProcess, port: int, path: str, name: str) -> None:
    """Return once ``GET path`` on loopback ``port`` answers 200; raise if ``proc`` exits first or
    :data:`READY_TIMEOUT_S` passes (the peers' start-up wait, one for every HTTP peer)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{name} exited early:\n{proc.log_tail()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            ready = conn.getresponse().status == 200
            conn.close()
            if ready:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready after {READY_TIMEOUT_S:.0f} s")


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (Ray's GCS, raylet and workers hang below ours)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class ManagedProcess:
    """A server subprocess in its own session, stopped with SIGINT, then SIGKILL after 60 s.

    ``start_new_session`` keeps Ctrl-C in the terminal from reaching the server directly and
    lets the fallback kill its whole process group. Descendants that left the group (Ray
    starts some daemons in their own sessions) are remembered and killed by pid if they
    outlive the server: every process this benchmark starts, it stops.
    """

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=REPO,
        )
        self._known: dict[int, float] = {}
        self.stop_s: float | None = None
        """Seconds from SIGINT to exit (None until stopped)."""
        self.killed = False
        """True if SIGINT did not stop it within the grace period and SIGKILL did."""

    def remember_tree(self) -> None:
        """Note every descendant (pid + create time), so stop() can find stragglers."""
        for p in process_tree(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                self._known[p.pid] = p.create_time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        self.remember_tree()
        t0 = time.perf_counter()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.stop_s = time.perf_counter() - t0
        self._kill_stragglers()
        self._log.close()

    def kill(self) -> None:
        """Immediate stop (memory guard): the group, then every remembered descendant."""
        self.remember_tree()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._kill_stragglers()

    def _kill_stragglers(self) -> None:
        deadline = time.monotonic() + 20
        for pid, created in self._known.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() != created:  # the pid was reused by someone else's process
                    continue
                if time.monotonic() < deadline:
                    with contextlib.suppress(psutil.TimeoutExpired):
                        p.wait(timeout=max(0.1, deadline - time.monotonic()))
                        continue
                p.kill()
            except psutil.NoSuchProcess:
                continue


# ---------------------------------------------------------------------------------------
# (b), (c) hotloop-serve
# ---------------------------------------------------------------------------------------


class ProcessServer:
    """What every server under test shares: its :class:`ManagedProcess` (``_proc``, set by
    ``start``), the pid and process the harness measures, and a stop of that process."""

    _proc: ManagedProcess | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.proc.pid

    @property
    def process(self) -> ManagedProcess:
        assert self._proc is not None
        return self._proc

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()

    def notes(self) -> dict[str, Any]:
        return {}


class HotloopServer(ProcessServer):
    """``hotloop-serve run --config <tmp.yaml>`` with ``replicas`` replicas of the model.

    The cores are split between replicas (``threads // replicas`` each, ``num_cpus: 1``):
    llama.cpp's worker threads spin while they wait, so two replicas of 2 threads each on
    2 cores would mostly wait on each other.
    """

    def __init__(self, key: str, replicas: int, threads: int, engine: dict[str, Any] | None = None) -> None:
        self.key = key
        self.replicas = replicas
        self.threads = max(1, threads // replicas)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.label = f"hotloop-serve, {replicas} replica{'s' if replicas > 1 else ''}"
        if engine:
            self.label += ", " + ", ".join(f"{k} {v}" for k, v in engine.items())
        self.config: dict[str, Any] = {
            "server": {"grpc_port": self.grpc_port, "http_port": self.http_port},
            "telemetry": {"enabled": False},
            "models": [
                {
                    "name": MODEL_NAME,
                    "replicas": replicas,
                    "resources": {"num_cpus": 1},
                    "engine": {
                        "context_tokens": 32768,
                        "session_context_tokens": 8192,
                        "hot_sessions": 8,
                        "threads": self.threads,
                        **(engine or {}),
                    },
                }
            ],
        }
        self._proc: ManagedProcess | None = None
        self._client: Any = None
        self._config_file: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, log_path: Path) -> None:
        import yaml
        from hotloop_client import Client

        from hotloop_serve.serve.probe import wait_until_serving

        fd, name = tempfile.mkstemp(prefix="hotloop-bench-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.config, f)
        self._config_file = Path(name)
        # Several replicas need a session secret (hotloop_serve.serve.app.session_secret).
        secret = os.environ.get("HOTLOOP_SESSION_SECRET") or secrets.token_urlsafe(32)
        env = {**os.environ, "HOTLOOP_SESSION_SECRET": secret}
        self._proc = ManagedProcess([str(HOTLOOP_CLI), "run", "--config", name], log_path, env=env)
        self._client = Client(self.address, timeout=REQUEST_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if not self._proc.alive():
                raise RuntimeError(f"hotloop-serve exited early:\n{self._proc.log_tail()}")
            try:  # the CLI's own check (``hotloop-serve start``): the model's health is SERVING
                wait_until_serving(self.address, [MODEL_NAME], timeout_s=5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"hotloop-serve not ready after {READY_TIMEOUT_S:.0f} s") from None

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation:
        return HotloopConversation(self._client, script.seed, spec)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().stop()
        if self._config_file is not None:
            self._config_file.unlink(missing_ok=True)

    def notes(self) -> dict[str, Any]:
        return {"threads_per_replica": self.threads}


class HotloopConversation:
    """A hotloop session through the Python SDK; token counts come from the final ``usage``."""

    def __init__(self, client: Any, seed: int, spec: WorkloadSpec) -> None:
        from hotloop_client import Settings

        settings = Settings(
            temperature=spec.temperature,
            sample_len=spec.sample_len,
            seed=seed,
            top_k=spec.top_k,
            top_p=spec.top_p,
            min_p=spec.min_p,
            repeat_penalty=spec.repeat_penalty,
        )
        self._session = client.model(MODEL_NAME).new_session(settings=settings)
        self._last = Reply()

    @property
    def last(self) -> Reply:
        return self._last

    def stream(self, history: Sequence[Turn]) -> Iterator[str]:
        for chunk in self._session.generate(list(history)):
            if chunk.text:
                yield chunk.text
            if chunk.usage is not None:
                u = chunk.usage
                self._last = Reply(
                    tokens=u.completion_tokens,
                    finish=chunk.finish_reason.value if chunk.finish_reason else "",
                    prompt_tokens=u.prompt_tokens,
                    cached_tokens=u.cached_tokens,
                    prefilled_tokens=u.prefilled_tokens,
                    replica=chunk.served_by.replica if chunk.served_by else None,
                    queue_ms=chunk.timings.queue_ms if chunk.timings else None,
                    prefill_ms=chunk.timings.prefill_ms if chunk.timings else None,
                    decode_ms=chunk.timings.decode_ms if chunk.timings else None,
                )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._session.close(timeout=10)


# ---------------------------------------------------------------------------------------
# Memory sampling
# ---------------------------------------------------------------------------------------


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores)."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


class RssSampler:
    """Peak RSS of a process tree, summed, every 0.2 s (Ray spawns workers below the server),
    and where the machine's CPU time went during the run.

    The RSS sum counts shared pages (the mmapped model file, shared libraries) once per
    process, so it overstates what the tree costs the machine; it is the figure ``ps``
    users would add up. ``on_low_memory`` runs once if the machine runs short (see
    MEMORY_FLOOR).

    CPU: other people's jobs share these cores, so the report says how many cores' worth of
    CPU went to processes that are neither the server tree nor this client ("other");
    a run with other > 0.5 on 2 cores was measured on a busy machine.
    """

    def __init__(self, pid: int, on_low_memory: Callable[[], None], interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.peak_processes = 0
        self.low_memory = False
        self.server_cpu_s = 0.0
        self.client_cpu_s = 0.0
        self.machine_cpu_s = 0.0
        self._on_low_memory = on_low_memory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._cpu_first: dict[tuple[int, float], float] = {}
        self._cpu_last: dict[tuple[int, float], float] = {}
        self._started = False
        self._me = psutil.Process()

    def __enter__(self) -> RssSampler:
        self._machine0 = _busy_cpu_s()
        t = self._me.cpu_times()
        self._client0 = t.user + t.system
        self.sample()  # baseline CPU of the processes already running (startup, warmup)
        self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.machine_cpu_s = _busy_cpu_s() - self._machine0
        t = self._me.cpu_times()
        self.client_cpu_s = t.user + t.system - self._client0
        self.server_cpu_s = sum(self._cpu_last[k] - self._cpu_first[k] for k in self._cpu_last)

    @property
    def other_cpu_s(self) -> float:
        return max(0.0, self.machine_cpu_s - self.server_cpu_s - self.client_cpu_s)

    def sample(self) -> int:
        total, n = 0, 0
        for p in process_tree(self.pid):
            with contextlib.suppress(psutil.Error):
                with p.oneshot():
                    total += p.memory_info().rss
                    t = p.cpu_times()
                    key = (p.pid, p.create_time())
                cpu = t.user + t.system
                # a process born during the run starts from 0; one running before, from now
                self._cpu_first.setdefault(key, cpu if not self._started else 0.0)
                self._cpu_last[key] = cpu
                n += 1
        self.peak_processes = max(self.peak_processes, n)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            if not self.low_memory and psutil.virtual_memory().available < MEMORY_FLOOR:
                self.low_memory = True
                self._on_low_memory()
            self._stop.wait(self.interval_s)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its live descendants."""
    total = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def other_jobs_cores(server_pid: int, window_s: float = 5.0) -> float:
    """Cores' worth of CPU used by processes other than the server tree and this client."""
    me = psutil.Process()

    def own() -> float:
        t = me.cpu_times()
        return float(t.user + t.system)

    m0, s0, c0 = _busy_cpu_s(), tree_cpu_s(server_pid), own()
    time.sleep(window_s)
    m1, s1, c1 = _busy_cpu_s(), tree_cpu_s(server_pid), own()
    return max(0.0, (m1 - m0) - (s1 - s0) - (c1 - c0)) / window_s


def wait_until_quiet(server_pid: int, max_wait_s: float, threshold_cores: float = 0.3) -> float:
    """Wait (at most ``max_wait_s``) until other jobs use under ``threshold_cores``.

    Other engineers' tests share this 2-core machine; with llama.cpp's threads on every
    core, one busy neighbour slows decoding many-fold (its threads meet at a barrier per
    graph node). Starting in a quiet moment does not keep the run quiet, but it avoids
    starting in the middle of someone's test. Returns the last measured figure.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        other = other_jobs_cores(server_pid)
        if other < threshold_cores or time.monotonic() >= deadline:
            return other
        print(f"  other jobs use {other:.2f} cores; waiting for a quieter moment ...", flush=True)


# ---------------------------------------------------------------------------------------
# Driving the workload
# ---------------------------------------------------------------------------------------


def run_session(
    conv: Conversation, script: SessionScript, turns: int, t0: float, records: list[TurnRecord], lock: threading.Lock
) -> None:
    """Play one session's turns, appending each reply to the history: from its arrival time, each
    follow-up after its think time (both 0 unless the workload has arrivals and think times)."""
    replies: list[str] = []
    if script.start_s > 0:
        time.sleep(max(0.0, t0 + script.start_s - time.perf_counter()))
    for turn in range(1, turns + 1):
        if turn > 1 and script.think_s and script.think_s[turn - 2] > 0:
            time.sleep(script.think_s[turn - 2])
        history = script.history(turn, replies)
        rec = TurnRecord(session=script.index, turn=turn, start_s=time.perf_counter() - t0)
        first = last = None
        parts: list[str] = []
        try:
            for text in conv.stream(history):
                now = time.perf_counter() - t0
                if first is None:
                    first = now
                last = now
                parts.append(text)
            rec.end_s = time.perf_counter() - t0
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            rec.end_s = time.perf_counter() - t0
        rec.text = "".join(parts)
        if first is not None and last is not None:
            rec.ttft_s = first - rec.start_s
            rec.decode_s = last - first
        rec.reply = conv.last
        with lock:
            records.append(rec)
        if rec.error is not None:
            return  # the history cannot continue without this reply
        replies.append(rec.text)


def warm_up(server: Server, workload: Workload) -> None:
    """Two short concurrent turns before timing: page the model in, start lazy pieces.

    Both systems get the same warmup; it is not part of any figure.
    """
    spec = WorkloadSpec(sessions=2, turns=1, sample_len=4, seed=workload.spec.seed + 1)
    warm = build_workload(spec)
    convs = [server.conversation(s, spec) for s in warm.sessions]

    def one(conv: Conversation, script: SessionScript) -> None:
        for _ in conv.stream([("system", script.system_prompt), ("user", "Say hello.")]):
            pass

    threads = [threading.Thread(target=one, args=(c, s)) for c, s in zip(convs, warm.sessions, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in convs:
        c.close()


@dataclass
class SystemResult:
    """Everything measured for one system."""

    key: str
    label: str
    config: dict[str, Any]
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    peak_processes: int = 0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    other_cpu_s: float = 0.0
    """CPU seconds used by processes other than the server tree and this client (other jobs)."""
    other_cores_before: float | None = None
    """Other jobs' CPU just before the run (measured with --wait-quiet)."""
    stop_s: float | None = None
    killed_on_stop: bool = False
    startup_s: float = 0.0
    load_avg_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    aborted: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def run_system(
    server: Server, workload: Workload, log_dir: Path, prefix: str = "peer", wait_quiet_s: float = 0.0
) -> SystemResult:
    """Start ``server``, warm it, run the workload with every session at once, stop it."""
    result = SystemResult(key=server.key, label=server.label, config=server.config)
    log_path = log_dir / f"{prefix}_{server.key}.log"
    print(f"[{server.key}] starting {server.label} (log {log_path}) ...", flush=True)
    t_start = time.perf_counter()
    try:
        server.start(log_path)
        result.startup_s = time.perf_counter() - t_start
        print(f"[{server.key}] ready in {result.startup_s:.1f} s; warming up ...", flush=True)
        warm_up(server, workload)
        convs = [server.conversation(s, workload.spec) for s in workload.sessions]
        process = server.process
        process.remember_tree()
        if wait_quiet_s > 0:
            result.other_cores_before = wait_until_quiet(server.pid, wait_quiet_s)
        result.load_avg_before = os.getloadavg()
        records: list[TurnRecord] = []
        lock = threading.Lock()

        def low_memory() -> None:
            result.aborted = f"available memory fell below {MEMORY_FLOOR / GiB:.1f} GiB: server killed"
            print(f"[{server.key}] {result.aborted}", flush=True)
            process.kill()

        print(f"[{server.key}] running {describe(workload)} ...", flush=True)
        with RssSampler(server.pid, low_memory) as sampler:
            t0 = time.perf_counter()
            threads = [
                threading.Thread(
                    target=run_session,
                    args=(conv, script, workload.spec.turns, t0, records, lock),
                    name=f"session-{script.index}",
                )
                for conv, script in zip(convs, workload.sessions, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            result.wall_s = time.perf_counter() - t0
            process.remember_tree()
        result.peak_rss_bytes = sampler.peak_bytes
        result.peak_processes = sampler.peak_processes
        result.server_cpu_s, result.client_cpu_s = sampler.server_cpu_s, sampler.client_cpu_s
        result.other_cpu_s = sampler.other_cpu_s
        result.turns = sorted(records, key=lambda r: (r.session, r.turn))
        for conv in convs:
            conv.close()
    except Exception as exc:
        result.aborted = result.aborted or f"{type(exc).__name__}: {exc}"[:2000]
        print(f"[{server.key}] failed: {result.aborted}", flush=True)
    finally:
        print(f"[{server.key}] stopping ...", flush=True)
        server.stop()
        with contextlib.suppress(AssertionError):
            result.stop_s, result.killed_on_stop = server.process.stop_s, server.process.killed
    result.notes = server.notes()
    result.summary = summarize(result, workload.spec)
    return result


# ---------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]; 50 is the median); None for no values.
    The one definition every bench's p50/p90/p99 uses, so figures of two benches compare."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(result: SystemResult, spec: WorkloadSpec) -> dict[str, Any]:
    """The report's figures for one system (definitions in bench/README.md)."""
    ok = [r for r in result.turns if r.error is None and r.ttft_s is not None]
    first = [r.ttft_s for r in ok if r.turn == 1 and r.ttft_s is not None]
    follow = [r.ttft_s for r in ok if r.turn >= 2 and r.ttft_s is not None]
    tokens = sum(r.reply.tokens for r in ok)
    per_session: list[float] = []
    for s in sorted({r.session for r in ok}):
        mine = [r for r in ok if r.session == s]
        decode = sum(r.decode_s or 0.0 for r in mine)
        after_first = sum(max(0, r.reply.tokens - 1) for r in mine)
        if decode > 0:
            per_session.append(after_first / decode)
    follow_ok = [r for r in ok if r.turn >= 2 and r.reply.prompt_tokens]
    cached_share = (
        sum(r.reply.cached_tokens or 0 for r in follow_ok) / sum(r.reply.prompt_tokens or 0 for r in follow_ok)
        if follow_ok
        else None
    )
    return {
        "turns_ok": len(ok),
        "turns_expected": spec.sessions * spec.turns,
        "errors": sum(1 for r in result.turns if r.error is not None),
        "empty_replies": sum(1 for r in result.turns if r.error is None and r.ttft_s is None),
        "followup_ttft_median_s": percentile(follow, 50),
        "followup_ttft_p90_s": percentile(follow, 90),
        "followup_ttft_p99_s": percentile(follow, 99),
        "first_ttft_median_s": percentile(first, 50),
        "first_ttft_p90_s": percentile(first, 90),
        "first_ttft_p99_s": percentile(first, 99),
        "ttft_mean_s": sum(first + follow) / len(first + follow) if first or follow else None,
        "generated_tokens": tokens,
        "aggregate_tok_s": tokens / result.wall_s if result.wall_s > 0 else None,
        "per_session_tok_s_median": statistics.median(per_session) if per_session else None,
        "wall_s": result.wall_s,
        "peak_rss_gib": result.peak_rss_bytes / GiB,
        "other_jobs_cores": result.other_cpu_s / result.wall_s if result.wall_s > 0 else None,
        "server_cores": result.server_cpu_s / result.wall_s if result.wall_s > 0 else None,
        "followup_cached_prompt_share": cached_share,
        "replicas_seen": sorted({r.reply.replica for r in ok if r.reply.replica}),
    }


def machine_facts() -> dict[str, Any]:
    """Where the figures come from: cores, memory, CPU model, load (others share the box)."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu_model,
        "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
