"""The strongest single-machine peer: llama.cpp's own ``llama-server``, and an OpenAI client for it.

``llama-server`` batches all its slots in one decode loop, keeps each slot's prompt, and keeps
conversations that lost their slot in a host-RAM prompt cache: the same llama.cpp as our engine
(its source ships in the llama-cpp-python sdist we install), so a comparison measures the
serving around llama.cpp, not llama.cpp. :func:`llama_server_binary` builds it once per
llama-cpp-python version, outside the repository (``~/.cache/hotloop-peer/``, about 7 minutes on
2 cores), and reuses it after.

:class:`LlamaServer` starts it with the flags a careful operator would pick for N concurrent chats
(each documented there). :class:`OpenAIConversation` is the client both it and hotloop-serve's
OpenAI HTTP API are driven through: the same bytes on the wire for both systems, the whole
history each turn, usage (with ``cached_tokens``) from the stream's last chunk.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REQUEST_TIMEOUT_S, Conversation, ManagedProcess, ProcessServer, Reply, wait_http_ready
from workload import SessionScript, Turn, WorkloadSpec

from hotloop_serve.serve.probe import free_port

CACHE = Path(os.environ.get("HOTLOOP_PEER_CACHE", Path.home() / ".cache" / "hotloop-peer"))


def llama_server_binary(log: Path | None = None) -> Path:
    """``llama-server`` built from the installed llama-cpp-python's sdist (the same llama.cpp as
    the engine), cached per version; built on first use."""
    version = importlib.metadata.version("llama-cpp-python")
    home = CACHE / f"llama-server-{version}"
    binary = home / "bin" / "llama-server"
    if binary.exists():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    out = open(log or home / "build.log", "w")  # noqa: SIM115 - closed below
    try:
        with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
            print(f"building llama-server {version} (once; ~7 min on 2 cores) ...", flush=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={version}", "-d", tmp],
                check=True, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            src = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
            build = Path(tmp) / "build"
            subprocess.run(
                ["cmake", "-S", str(src), "-B", str(build), "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DCMAKE_BUILD_TYPE=Release"],
                check=True, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            jobs = str(len(os.sched_getaffinity(0)))
            subprocess.run(
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
                check=True, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            (home / "bin").mkdir(exist_ok=True)
            for f in (build / "bin").iterdir():  # the binary and the shared libraries it loads
                shutil.copy2(f, home / "bin" / f.name, follow_symlinks=False)
    finally:
        out.close()
    return binary


class LlamaServer(ProcessServer):
    """``llama-server`` configured as a careful operator would for ``slots`` concurrent chats.

    - ``-np SLOTS -c SLOTS*PER_SLOT --kv-unified``: one KV pool shared by all slots (a long chat
      may use more than its share), ``PER_SLOT`` cells each on average.
    - ``--swa-full``: a full-size cache for Gemma 3's sliding-window layers, so a slot's prompt can
      be reused past the window (without it every follow-up over 512 tokens re-prefills).
    - ``--cache-reuse 256``: reuse chunks of a slot's cache shifted by a small edit.
    - ``--cache-ram`` left at its default (8 GiB): conversations that lost their slot are restored
      from host RAM instead of being prefilled again.
    - ``-t``/``-tb``: every core, as hotloop-serve uses; ``--no-jinja --chat-template gemma`` (the
      GGUF has none; llama.cpp's built-in Gemma format, as hotloop-serve's). ``--no-jinja`` must come
      first: with Jinja on (llama-server's default) the name ``gemma`` is taken as a template's
      source and every prompt renders as the word "gemma" (3 tokens), so the peer would answer
      empty prompts. :meth:`start` checks the rendering before any figure is taken.
    """

    def __init__(self, model_path: Path, threads: int, slots: int, per_slot: int = 4096, key: str = "l") -> None:
        self.key = key
        self.port = free_port()
        self.label = f"llama-server -np {slots}"
        self.binary = llama_server_binary()
        self.args = [
            str(self.binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(slots), "-c", str(slots * per_slot), "-t", str(threads), "-tb", str(threads),
            "--kv-unified", "--swa-full", "--cache-reuse", "256", "--no-jinja", "--chat-template", "gemma",
            "--no-webui", "--metrics",
        ]  # fmt: skip
        self.config: dict[str, Any] = {"command": " ".join(self.args[1:]), "binary": str(self.binary)}
        self._proc: ManagedProcess | None = None

    def start(self, log_path: Path) -> None:
        env = {**os.environ, "LD_LIBRARY_PATH": str(self.binary.parent)}
        self._proc = ManagedProcess(self.args, log_path, env=env)
        wait_http_ready(self._proc, self.port, "/health", "llama-server")
        self._check_template()

    def _check_template(self) -> None:
        """Fail unless the server renders a chat's messages into its prompt (see the class doc)."""
        probe = "Probe: the quick brown fox."
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": probe}]}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/apply-template", body=json.dumps(body), headers={"Content-Type": "application/json"})
            prompt = json.loads(conn.getresponse().read()).get("prompt", "")
        finally:
            conn.close()
        if probe not in prompt or "Be brief." not in prompt:
            self.stop()
            raise RuntimeError(f"llama-server does not render chat messages into its prompt: {prompt[:200]!r}")

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation:
        return OpenAIConversation(self.port, "/v1/chat/completions", "gemma", script.seed, spec)


class OpenAIConversation:
    """One chat over ``/v1/chat/completions`` with SSE, plain ``http.client`` (no dependency).

    The whole history goes out each turn (as every stateless OpenAI client sends it); usage
    comes from the last chunk (``stream_options.include_usage``), with
    ``prompt_tokens_details.cached_tokens`` where the server reports it (both do). A session
    header names the conversation for servers that take one (hotloop-serve's ``X-Session-Id``;
    llama-server ignores it).
    """

    def __init__(self, port: int, path: str, model: str, seed: int, spec: WorkloadSpec) -> None:
        self.port = port
        self.path = path
        self.model = model
        self.seed = seed
        self.spec = spec
        self._last = Reply()

    @property
    def last(self) -> Reply:
        return self._last

    def stream(self, history: Sequence[Turn]) -> Iterator[str]:
        body = {
            "model": self.model,
            "messages": [{"role": r, "content": c} for r, c in history],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.spec.sample_len,
            "temperature": self.spec.temperature,
            "top_k": self.spec.top_k,
            "top_p": self.spec.top_p,
            "min_p": self.spec.min_p,
            "repeat_penalty": self.spec.repeat_penalty,
            "seed": self.seed,
        }
        headers = {"Content-Type": "application/json", "X-Session-Id": f"bench-{self.seed}"}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", self.path, body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            deltas, finish, usage = 0, "", None
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    if text:
                        deltas += 1
                        yield text
            reply = Reply(tokens=deltas, finish=finish)
            if usage:
                reply.tokens = int(usage.get("completion_tokens") or deltas)
                reply.prompt_tokens = usage.get("prompt_tokens")
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                reply.cached_tokens = cached
                if reply.prompt_tokens is not None and cached is not None:
                    reply.prefilled_tokens = reply.prompt_tokens - cached
            self._last = reply
        finally:
            conn.close()

    def close(self) -> None:
        pass


class RoundRobinProxy:
    """What an operator without a session-aware router puts in front of two servers: each
    request to the next backend in turn (an nginx/Envoy ``round_robin`` upstream), the response
    streamed back as it comes. A session's follow-up therefore lands on the other server half
    the time, whose slots and prompt cache have never seen its history. Runs in this process."""

    def __init__(self, backends: Sequence[int]) -> None:
        import itertools
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        turn = itertools.cycle(backends)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                with lock:
                    port = next(turn)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
                try:
                    upstream.request(method, self.path, body=body, headers=headers)
                    resp = upstream.getresponse()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                finally:
                    upstream.close()
                self.close_connection = True

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the default listen backlog (5) resets a burst of new chats

        self.port = free_port()
        self._server = Server(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="round-robin", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class LlamaServerPair(ProcessServer):
    """Two ``llama-server`` processes (each half the cores and half the slots, flags as
    :class:`LlamaServer`) behind a :class:`RoundRobinProxy`: W4's peer. Both run under one shell
    so the harness measures their memory and CPU as one tree; the proxy's CPU is the client's."""

    def __init__(self, model_path: Path, threads: int, slots: int, per_slot: int = 4096, key: str = "p") -> None:
        self.key = key
        self.halves = [LlamaServer(model_path, max(1, threads // 2), max(1, slots // 2), per_slot) for _ in range(2)]
        self.label = f"2 x llama-server -np {max(1, slots // 2)} -t {max(1, threads // 2)}, round-robin proxy"
        self.config: dict[str, Any] = {"commands": [h.config["command"] for h in self.halves]}
        self._proc: ManagedProcess | None = None
        self._proxy: RoundRobinProxy | None = None

    def start(self, log_path: Path) -> None:
        import shlex

        env = {**os.environ, "LD_LIBRARY_PATH": str(self.halves[0].binary.parent)}
        # Background jobs of a non-interactive shell ignore SIGINT: the trap passes the harness's
        # stop on as SIGTERM, which llama-server handles like Ctrl-C.
        a, b = (shlex.join(h.args) for h in self.halves)
        script = f"{a} & A=$!; {b} & B=$!; trap 'kill -TERM $A $B' INT TERM; wait; wait"
        self._proc = ManagedProcess(["bash", "-c", script], log_path, env=env)
        for half in self.halves:
            half._proc = self._proc  # one process tree; each half's readiness and template checked
            wait_http_ready(self._proc, half.port, "/health", "llama-server")
            half._check_template()
        self._proxy = RoundRobinProxy([h.port for h in self.halves])

    def conversation(self, script: SessionScript, spec: WorkloadSpec) -> Conversation:
        assert self._proxy is not None
        return OpenAIConversation(self._proxy.port, "/v1/chat/completions", "gemma", script.seed, spec)

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.close()
        super().stop()
