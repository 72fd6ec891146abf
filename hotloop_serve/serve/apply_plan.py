"""What ``hotloop-serve apply`` would change on a running server, decided before touching it.

Pure functions over two documents: the live state (what Serve's controller reports) and the
new config. Each model gets one verdict, with the reason an operator needs:

- ``in place``: only fleet fields changed (replicas, autoscaling bounds, requests per
  replica): Serve keeps the running replicas; about 1/N of the sessions move to a joining
  replica (fetched on first use) or from a leaving one (handed over at its shutdown).
- ``roll``: anything a replica is built from changed (engine options, limits, model...):
  every replica is replaced one after the other, each leaving one handing its sessions over.
- ``add`` / ``remove`` (``remove`` only with ``--prune``) / ``unchanged`` / ``keep`` (running,
  not in the file, left as it is).

Refused, with the way out: what Serve's proxies fixed at start (gRPC/HTTP port and host,
the gRPC request timeout, the proxy's message limit), an app of the same name deployed
outside a config (``serve.run``), and models not in the file without ``--prune``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.serve.app import PROXY_MESSAGE_SLACK, proxy_message_limit
from hotloop_serve.serve.declarative import applications

ADD, IN_PLACE, ROLL, UNCHANGED, REMOVE, KEEP = "add", "in place", "roll", "unchanged", "remove", "keep"


@dataclass
class Change:
    model: str
    action: str
    details: list[str] = field(default_factory=list)


@dataclass
class Plan:
    changes: list[Change]
    refusals: list[str]
    apps: list[dict[str, Any]]
    """The whole declarative document to submit (file apps, plus kept live ones)."""

    @property
    def rolling(self) -> set[str]:
        return {c.model for c in self.changes if c.action == ROLL}

    @property
    def changed(self) -> bool:
        return any(c.action not in (UNCHANGED, KEEP) for c in self.changes)


@dataclass
class Live:
    """The running server as the plan needs it (built from Serve's controller by ``cluster.py``)."""

    grpc_port: int | None
    http_port: int | None
    http_host: str | None
    grpc_request_timeout_s: float | None
    declarative: dict[str, dict[str, Any]]
    """App name -> the application entry it was deployed with."""
    imperative: set[str]


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; a list of named mappings (``models``) is keyed by name."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        out = {}
        for v in value:
            out.update(_flat(v, f"{prefix}[{v['name']}]"))
        return out
    return {prefix: value}


def diff(old: Any, new: Any) -> list[str]:
    """``path: old -> new`` for every leaf that differs."""
    a, b = _flat(old), _flat(new)
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in keys if a.get(k) != b.get(k)]


def _policies(app: dict[str, Any]) -> list[Any]:
    """The autoscaling policies Serve hashes: one per autoscaled deployment, so switching
    between a fixed count and autoscaling changes the code version."""
    scalings = [d.get("autoscaling_config") for d in app.get("deployments") or []]
    return [s.get("policy") for s in scalings if isinstance(s, dict)]


def _code(app: dict[str, Any]) -> dict[str, Any]:
    """What Serve hashes into the app's code version (``deploy_utils.get_app_code_version``)."""
    return {
        "import_path": app.get("import_path"),
        "runtime_env": app.get("runtime_env") or {},
        "args": app.get("args"),
        "policies": _policies(app),
    }


def _fleet(app: dict[str, Any]) -> dict[str, Any]:
    deployments = app.get("deployments") or [{}]
    return {k: v for k, v in deployments[0].items() if k != "name"}


def _roll_reasons(model: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_cfg, new_cfg = (a.get("args", {}).get("config", {}) for a in (old, new))
    old_names = [m.get("name") for m in old_cfg.get("models", [])]
    new_names = [m.get("name") for m in new_cfg.get("models", [])]
    reasons = []
    if old_names != new_names:
        reasons.append(f"the model list changed {old_names} -> {new_names} (each replica lists every model)")
    mine = [d for d in diff(old_cfg, new_cfg) if d.startswith(f"models[{model}].")]
    others = [d for d in diff(old_cfg, new_cfg) if not d.startswith("models[")]
    reasons += mine + others
    if old.get("import_path") != new.get("import_path") or (old.get("runtime_env") or {}) != {}:
        reasons.append(f"import_path/runtime_env: {old.get('import_path')} -> {new.get('import_path')}")
    if _policies(old) != _policies(new):
        if bool(_policies(old)) == bool(_policies(new)):  # server.direct_ingress picks the policy
            how = "to another autoscaling policy"
        else:
            how = "to autoscaling" if _policies(new) else "from autoscaling to a fixed count"
        reasons.append(f"switching {how} (Serve hashes the autoscaling policy into the code version)")
    if not reasons:
        reasons = [f"another model's section changed: {d}" for d in diff(old_cfg, new_cfg)][:3]
    return reasons


def _proxy_refusals(live: Live, config: Config) -> list[str]:
    restart = "Serve's proxies keep what they started with: `hotloop-serve stop` then `start` with this config"
    s = config.server
    checks = [
        ("server.grpc_port", live.grpc_port, s.grpc_port),
        ("server.http_port", live.http_port, s.http_port),
        ("server.host", live.http_host, s.host),
        ("server.request_timeout_s", live.grpc_request_timeout_s, s.request_timeout_s),
    ]
    out = [f"{name} {old} -> {new}: {restart}" for name, old, new in checks if old is not None and old != new]
    for app in live.declarative.values():
        try:
            before = proxy_message_limit(config_from_dict(app["args"]["config"]))
        except Exception:  # not a hotloop app: nothing to compare with
            continue
        largest = max(m.limits.max_request_bytes for m in config.models)
        if proxy_message_limit(config) > before:
            out.append(
                f"limits.max_request_bytes {largest} is above the {before - PROXY_MESSAGE_SLACK} bytes the gRPC "
                f"proxy's message limit was set for at start; {restart}"
            )
        break
    return out


def make_plan(live: Live, config: Config, prune: bool = False) -> Plan:
    """Decide every model's verdict and the document to submit; nothing is changed here."""
    new_apps = applications(config)
    refusals = _proxy_refusals(live, config)
    changes: list[Change] = []
    for app in new_apps:
        name = app["name"]
        if name in live.imperative:
            refusals.append(
                f"{name}: running, but deployed with serve.run, not from a config; "
                f"`serve.delete('{name}')` it (or rename the model) and apply again"
            )
            continue
        old = live.declarative.get(name)
        if old is None:
            changes.append(Change(name, ADD, [f"{k}: {v}" for k, v in _fleet(app).items() if v is not None]))
        elif _code(old) != _code(app):
            changes.append(Change(name, ROLL, _roll_reasons(name, old, app)))
        elif _fleet(old) != _fleet(app):
            changes.append(Change(name, IN_PLACE, diff(_fleet(old), _fleet(app))))
        else:
            changes.append(Change(name, UNCHANGED))
    names = {a["name"] for a in new_apps}
    kept = []
    for name, old in sorted(live.declarative.items()):
        if name in names:
            continue
        if prune:
            changes.append(Change(name, REMOVE, ["not in the config file (--prune)"]))
        else:
            changes.append(Change(name, KEEP, ["running, not in the config file: left as it is (--prune removes it)"]))
            kept.append(old)
    return Plan(changes, refusals, new_apps + kept)


def render(plan: Plan) -> list[str]:
    """The plan as lines for the terminal."""
    lines = []
    for c in plan.changes:
        what = {
            IN_PLACE: "changes in place (replicas kept; about 1/N of sessions move, caches follow)",
            ROLL: "rolls (every replica replaced one by one; leaving replicas hand their sessions over)",
            ADD: "is added",
            REMOVE: "is removed (its sessions end with it)",
            UNCHANGED: "unchanged",
            KEEP: "kept",
        }[c.action]
        lines.append(f"{c.model}: {what}")
        lines += [f"    {d}" for d in c.details]
    lines += [f"refused: {r}" for r in plan.refusals]
    return lines
