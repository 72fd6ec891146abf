"""Declarative deploys of a local server: the Serve document that ``start``/``run`` and ``apply`` share.

Why the document is split (read in Ray 2.60's ``application_state.apply_app_config`` and
``deploy_utils.get_app_code_version``): Serve hashes an application's ``import_path``,
``args`` and ``runtime_env`` into its *code version*. A new code version rebuilds the app and
every replica restarts (a rolling upgrade). With the same code version, the options listed
under ``deployments:`` are laid over the existing build: ``num_replicas`` is a lightweight
change and ``autoscaling_config`` / ``max_ongoing_requests`` only call the replicas'
``reconfigure``, so running replicas and their KV caches stay.

So each application's ``args`` carry the hotloop config with the *fleet fields* (how many
replicas, autoscaling bounds, requests per replica) normalised away, and those fields travel
in ``deployments:``. A replica never reads them from its config (Serve owns them), so the
normalisation changes nothing it does, except that ``ListModels`` reports the normalised
replica count. Everything else (engine options, limits, model path, auth...) is code: a change
rolls the replicas, and the leaving ones hand their sessions over.

Mixing with the imperative API: ``deploy_apps`` deletes declarative apps missing from the
document and never touches apps deployed with ``serve.run``; ``apply`` re-submits the live
document of declarative apps it is not told about, so it only changes what its file names.
"""

from __future__ import annotations

import time
from typing import Any

from hotloop_serve.config import Config, ModelConfig
from hotloop_serve.serve.app import BUILDER_IMPORT_PATH, max_ongoing_requests, session_secret
from hotloop_serve.serve.autoscaling import POLICY

FLEET_FIELDS = ("replicas", "autoscaling", "routing.max_ongoing_requests")
"""The model fields Serve applies in place (they never reach a replica's code version)."""


def code_config(config: Config) -> dict[str, Any]:
    """``config`` as the applications' ``args`` see it: every model's fleet fields at their defaults."""
    doc = config.model_dump(mode="json")
    for model in doc["models"]:
        model["replicas"] = 1
        model["autoscaling"] = None
        model["routing"]["max_ongoing_requests"] = None
    return doc


def fleet_options(model: ModelConfig, direct: bool = False) -> dict[str, Any]:
    """The ``deployments:`` entry of a model: what Serve may change without new replicas.

    Both ``num_replicas`` and ``autoscaling_config`` are always set (one of them null), so
    switching between a fixed count and autoscaling is explicit in either direction. With
    ``direct`` (``server.direct_ingress``) autoscaling counts direct streams: its ``policy``
    names ``autoscaling.direct_aware_policy``, the same path on every apply, so Serve's code
    version (which hashes it) only changes when direct ingress or autoscaling is switched.
    """
    options: dict[str, Any] = {"name": model.name, "max_ongoing_requests": max_ongoing_requests(model)}
    if model.autoscaling:
        a = model.autoscaling
        options["num_replicas"] = None
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "look_back_period_s": a.look_back_period_s,
        }
        if direct:
            options["autoscaling_config"]["policy"] = {"policy_function": POLICY}
    else:
        options["num_replicas"] = model.replicas
        options["autoscaling_config"] = None
    return options


def application(config: Config, model: ModelConfig, code: dict[str, Any] | None = None) -> dict[str, Any]:
    """One model's entry of the Serve document (``ServeApplicationSchema`` fields)."""
    return {
        "name": model.name,
        "route_prefix": f"/{model.name}",
        "import_path": BUILDER_IMPORT_PATH,
        "args": {"config": code if code is not None else code_config(config), "model": model.name},
        "deployments": [fleet_options(model, config.server.direct_ingress)],
    }


def applications(config: Config) -> list[dict[str, Any]]:
    """Every model's application, all with the same ``args`` config document."""
    code = code_config(config)
    return [application(config, m, code) for m in config.models]


def target_replicas(app: dict[str, Any]) -> tuple[int, int]:
    """(fewest, most) running replicas an application entry asks for."""
    (options,) = app["deployments"]
    scaling = options.get("autoscaling_config")
    if scaling:
        return int(scaling["min_replicas"]), int(scaling["max_replicas"])
    return int(options["num_replicas"]), int(options["num_replicas"])


def submit(apps: list[dict[str, Any]]) -> None:
    """Hand the whole declarative set to Serve's controller (returns once it has taken it).

    Declarative apps not in ``apps`` are deleted by Serve; apps deployed with ``serve.run``
    are left alone.
    """
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": apps}))


def deploy(config: Config, timeout_s: float = 600) -> None:
    """Deploy every model of ``config`` declaratively on the connected Serve (start/run).

    Live declarative apps not in ``config`` are removed (a fresh server has none).
    """
    session_secret(config)  # the builder sees one replica per app (fleet fields left out): check here
    apps = applications(config)
    submit(apps)
    wait_converged(apps, gone=set(), timeout_s=timeout_s)


def state_name(state: Any) -> str:
    """``RUNNING`` from a Serve state (an enum such as ``ReplicaState.RUNNING``, or its value)."""
    return str(getattr(state, "value", state)).rsplit(".", 1)[-1]


def replicas_by_state(app_name: str) -> dict[str, list[str]]:
    """Replica ids of an application's deployment by state (RUNNING, STARTING, STOPPING...)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    app = details.get("applications", {}).get(app_name)
    out: dict[str, list[str]] = {}
    if not app:
        return out
    for deployment in app.get("deployments", {}).values():
        for replica in deployment.get("replicas", []):
            out.setdefault(state_name(replica["state"]), []).append(str(replica["replica_id"]))
    return out


def wait_converged(apps: list[dict[str, Any]], gone: set[str], timeout_s: float) -> None:
    """Block until each app runs its target replica count with no replica starting or
    stopping, and no replica in ``gone`` (the ids a rolling upgrade replaces) is left.

    Raises ``TimeoutError`` naming what has not converged.
    """
    from ray import serve

    deadline = time.monotonic() + timeout_s
    pending = {a["name"]: a for a in apps}
    last = ""
    while pending:
        status = serve.status().applications
        for name, app in list(pending.items()):
            fewest, most = target_replicas(app)
            st = status.get(name)
            states = replicas_by_state(name) if st is not None else {}
            running = states.get("RUNNING", [])
            moving = {s: ids for s, ids in states.items() if s != "RUNNING" and ids}
            stale = gone & set(running)
            settled = st is not None and state_name(st.status) == "RUNNING" and not moving and not stale
            if settled and fewest <= len(running) <= most:
                del pending[name]
                continue
            app_status = st.status if st is not None else "not deployed yet"
            last = f"{name}: {app_status}, {len(running)} running (want {fewest}..{most}), others {moving}"
            if st is not None and state_name(st.status) == "DEPLOY_FAILED":
                raise RuntimeError(f"{name}: deploy failed: {st.message}")
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not converged in {timeout_s:.0f} s: {last}")
        if pending:
            time.sleep(0.5)
