"""`hotloop-serve`: run, start/stop/status in the background, chat, and print configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from hotloop_serve.config import Config, load_config

app = typer.Typer(help="Serve GGUF chat models over gRPC on Ray Serve, with hot KV caches per session.")
err = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (default: the embedded model)")]
PortOpt = Annotated[int | None, typer.Option("--port", "-p", help="gRPC port (overrides server.grpc_port)")]


def _state_dir() -> Path:
    d = Path(os.environ.get("HOTLOOP_HOME", Path.home() / ".hotloop"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _load(config: Path | None, port: int | None) -> Config:
    try:
        cfg = load_config(config)
    except Exception as e:
        err.print(f"[red]invalid config {config}:[/red] {e}")
        raise typer.Exit(2) from e
    if port is not None:
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"grpc_port": port})})
    return cfg


def _preflight(cfg: Config) -> None:
    """Refuse to start what the replicas would refuse (auth sources, session secret), clearly."""
    from hotloop_serve.serve.app import preflight

    try:
        for line in preflight(cfg):
            err.print(f"hotloop-serve: {line}")
    except ValueError as e:
        err.print(f"hotloop-serve: {e}", style="red", markup=False)
        raise typer.Exit(2) from e


def _address(cfg: Config) -> str:
    return f"127.0.0.1:{cfg.server.grpc_port}"


@app.command()
def run(
    config: ConfigOpt = None,
    port: PortOpt = None,
    chat: Annotated[bool, typer.Option(help="open a terminal chat; stop everything when it ends")] = False,
    address: Annotated[str | None, typer.Option(help="join this Ray cluster instead of starting one")] = None,
) -> None:
    """Run in the foreground; Ctrl-C stops Ray and everything it started."""
    from hotloop_serve.serve.model_source import resolve_model_path
    from hotloop_serve.serve.runner import start_server, stop_server, wait_until_serving

    cfg = _load(config, port)
    _preflight(cfg)
    for m in cfg.models:  # assemble/check model files here, with visible progress, not in a replica
        resolve_model_path(m.path)
    if address is None:
        from hotloop_serve.engine.cpus import cpu_budget
        from hotloop_serve.serve.runner import oversubscribed_cores

        warning = oversubscribed_cores(cfg, cpu_budget().threads)
        if warning:
            err.print(f"hotloop-serve: warning: {warning}", style="yellow", markup=False)
    err.print(f"hotloop-serve: starting Ray Serve with {len(cfg.models)} model(s) ...")
    t0 = time.perf_counter()
    try:
        start_server(cfg, address=address)
        from hotloop_serve.serve.ray_state import record_address

        record_address(_state_dir())
        wait_until_serving(_address(cfg), [m.name for m in cfg.models])
        err.print(
            f"hotloop-serve: serving {', '.join(m.name for m in cfg.models)} on grpc://{_address(cfg)} "
            f"(ready in {time.perf_counter() - t0:.1f} s)"
        )
        if chat:
            from hotloop_serve.cli.chat import run_chat

            run_chat(_address(cfg), cfg.models[0].name)
        else:
            err.print("Ctrl-C to stop")
            # Block, then wait for, SIGINT/SIGTERM: either one stops Ray and everything it started.
            stop_signals = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
            signal.sigwait(stop_signals)
    except KeyboardInterrupt:
        pass
    finally:
        err.print("hotloop-serve: stopping ...")
        stop_server()


@app.command()
def start(
    config: ConfigOpt = None,
    port: PortOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 600,
) -> None:
    """Start in the background and return once every model serves."""
    from hotloop_serve.serve.probe import wait_until_serving

    cfg = _load(config, port)
    _preflight(cfg)
    state = _state_dir()
    pid = _running_pid()
    if pid:
        err.print(f"hotloop-serve is already running (pid {pid}); `hotloop-serve stop` first")
        raise typer.Exit(1)
    args = [sys.executable, "-m", "hotloop_serve.cli.main", "run"]
    if config:
        args += ["--config", str(config.resolve())]
    if port:
        args += ["--port", str(port)]
    log_path = state / "server.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    (state / "server.json").write_text(json.dumps({"pid": proc.pid, "address": _address(cfg)}))
    try:
        wait_until_serving(_address(cfg), [m.name for m in cfg.models], timeout_s=timeout)
    except TimeoutError as e:
        err.print(f"[red]{e}[/red]; see {log_path}")
        raise typer.Exit(1) from e
    err.print(f"hotloop-serve: serving on grpc://{_address(cfg)} (pid {proc.pid}, log {log_path})")


def _running_pid() -> int | None:
    f = _state_dir() / "server.json"
    if not f.exists():
        return None
    pid = int(json.loads(f.read_text())["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        f.unlink(missing_ok=True)
        return None
    return pid


@app.command()
def stop(timeout: Annotated[float, typer.Option(help="seconds before killing")] = 60) -> None:
    """Stop the background server (its in-flight streams get the graceful shutdown period)."""
    pid = _running_pid()
    if not pid:
        err.print("hotloop-serve is not running")
        return
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(pid, signal.SIGKILL)
    (_state_dir() / "server.json").unlink(missing_ok=True)
    err.print("hotloop-serve stopped")


RayAddressOpt = Annotated[
    str | None,
    typer.Option("--ray-address", help="the server's Ray cluster (default: the one `hotloop-serve run` recorded)"),
]


def _attach(ray_address: str | None) -> None:
    from hotloop_serve.serve.ray_state import recorded, use_auth_mode

    found = recorded(_state_dir())
    address, auth_mode = (ray_address, None) if ray_address else (found or (None, None))
    if address is None:
        err.print("hotloop-serve is not running here (no Ray address recorded); pass --ray-address")
        raise typer.Exit(1)
    use_auth_mode(auth_mode)  # before Ray is imported
    from hotloop_serve.serve.cluster import attach

    try:
        attach(address, auth_mode)
    except Exception as e:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else " (a token-auth cluster needs RAY_AUTH_MODE=token)"
        err.print(f"hotloop-serve: cannot reach the server's Ray at {address}{hint}: {e}", style="red", markup=False)
        raise typer.Exit(1) from e


@app.command()
def apply(
    config: Annotated[Path, typer.Option("--config", "-c", help="the whole fleet's YAML config")],
    ray_address: RayAddressOpt = None,
    prune: Annotated[bool, typer.Option(help="remove running models that the file does not list")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan, change nothing")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the fleet to converge")] = 600,
) -> None:
    """Change a running server in place to match a config (like `serve deploy` / `kubectl apply`).

    Replica counts, autoscaling bounds and requests per replica change with the running
    replicas kept; anything else rolls the model's replicas (sessions handed over).
    """
    from hotloop_serve.cli.apply import run_apply

    cfg = _load(config, None)
    _preflight(cfg)
    _attach(ray_address)
    raise typer.Exit(run_apply(cfg, prune=prune, dry_run=dry_run, timeout_s=timeout))


@app.command()
def status(
    ray_address: RayAddressOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Per model: replicas (id, rank, state), sessions per replica (hot / RAM / disk), cache hit rates."""
    from hotloop_serve.cli.status_view import print_status

    _attach(ray_address)
    raise typer.Exit(print_status(as_json))


@app.command()
def chat(
    address: Annotated[str, typer.Option(help="server address")] = "127.0.0.1:9000",
    model: Annotated[str | None, typer.Option(help="model name (default: the first served)")] = None,
) -> None:
    """A streaming terminal chat with a running server."""
    from hotloop_serve.cli.chat import run_chat

    run_chat(address, model)


@app.command("config")
def show_config(
    config: ConfigOpt = None,
    serve: Annotated[bool, typer.Option("--serve", help="print the Ray Serve config (KubeRay serveConfigV2)")] = False,
) -> None:
    """Print the effective config (or the Serve config it deploys as)."""
    cfg = _load(config, None)
    if serve:
        from hotloop_serve.serve.app import serve_config

        typer.echo(yaml.safe_dump(serve_config(cfg), sort_keys=False))
    else:
        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


if __name__ == "__main__":
    app()
