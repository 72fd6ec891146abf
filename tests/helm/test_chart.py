"""The Helm chart (helm/hotloop-serve), checked offline.

- ``helm lint --strict`` and ``helm template`` for the default values and each ``ci/*.yaml``;
- every RayService against the KubeRay v1.7.0 CRD's openAPIV3Schema, with unknown fields
  rejected wherever the API server would prune them;
- every built-in object (and the pod templates and serve Service inside the RayService) with
  kubernetes-validate in strict mode for Kubernetes 1.33;
- GRPCRoute / Gateway against a hand-written subset of the Gateway API v1 schemas;
- PodMonitor against a hand-written subset of the Prometheus Operator v0.91.0 PodMonitor CRD schema;
- the serveConfigV2 contract: each application's ``args.config`` loads with
  ``hotloop_serve.config.config_from_dict`` and ``args.model`` names one of its models;
- bad values fail lint with a message naming the value.

The helm binary comes from ``scripts/fetch_helm.sh`` (``tools/helm``), ``$HELM`` or ``PATH``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hotloop_serve.config import Config, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "hotloop-serve"
HERE = Path(__file__).resolve().parent
RAYSERVICE_CRD = HERE / "crds" / "ray.io_rayservices.v1.7.0.yaml"
GATEWAY_SCHEMAS = HERE / "schemas" / "gateway-api-v1-subset.json"
PODMONITOR_SCHEMA = HERE / "schemas" / "prometheus-operator-v1-podmonitor-subset.json"
KUBE_VERSION = "1.33.0"
API_VERSIONS = ("ray.io/v1", "gateway.networking.k8s.io/v1")
RELEASE = "hl"

GRPC_SERVICERS = [
    "hotloop.v1.session_pb2_grpc.add_SessionServiceServicer_to_server",
    "hotloop.v1.model_pb2_grpc.add_ModelServiceServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]
CASES = ["default", *sorted(p.name for p in (CHART / "ci").glob("*.yaml"))]


def _find_helm() -> str | None:
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    local = ROOT / "tools" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("helm")


HELM = _find_helm()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm binary not found: run scripts/fetch_helm.sh (writes tools/helm) or set $HELM"
)


# --------------------------------------------------------------------------- helm runs


@functools.cache
def _helm_env() -> dict[str, str]:
    """Keep helm's config, cache and data out of the user's home (and away from any cluster)."""
    base = Path(os.environ.get("PYTEST_HELM_HOME", "/tmp")) / f"hotloop-helm-{os.getuid()}"
    env = dict(os.environ)
    for var in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
        path = base / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    env["KUBECONFIG"] = str(base / "no-kubeconfig")
    return env


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, env=_helm_env(), timeout=120, check=False)


def values_args(case: str) -> list[str]:
    return [] if case == "default" else ["-f", str(CHART / "ci" / case)]


def api_version_args() -> list[str]:
    return [arg for v in API_VERSIONS for arg in ("--api-versions", v)]


def template(*args: str) -> subprocess.CompletedProcess[str]:
    return helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *api_version_args(), *args)


@functools.cache
def render(case: str) -> tuple[dict[str, Any], ...]:
    result = template(*values_args(case))
    assert result.returncode == 0, f"helm template failed for {case}:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render_values(values: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return template("-f", str(path))


def lint_values(values: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return helm("lint", "--strict", str(CHART), "-f", str(path))


def docs_of(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def rayservice(case: str) -> dict[str, Any]:
    (rs,) = docs_of(render(case), "RayService")
    return rs


def serve_config(case: str) -> dict[str, Any]:
    raw = rayservice(case)["spec"]["serveConfigV2"]
    assert isinstance(raw, str)
    loaded = yaml.safe_load(raw)
    assert isinstance(loaded, dict)
    return loaded


def pod_templates(rs: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(group name, group spec, pod template) for the head and every worker group."""
    cluster = rs["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"], cluster["headGroupSpec"]["template"]
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group, group["template"]


def runs_replicas(name: str, group: dict[str, Any]) -> bool:
    return name != "head" or group["rayStartParams"].get("num-cpus") != "0"


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# --------------------------------------------------------------------------- schemas


def _impose_pruning(node: Any) -> None:
    """additionalProperties: false wherever a structural schema lists its fields and does not
    keep unknown ones: the API server would silently prune such fields."""
    if isinstance(node, dict):
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _impose_pruning(value)
    elif isinstance(node, list):
        for value in node:
            _impose_pruning(value)


@functools.cache
def rayservice_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(RAYSERVICE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _impose_pruning(schema)
    return jsonschema.Draft7Validator(schema)


@functools.cache
def gateway_validators() -> dict[str, jsonschema.Draft202012Validator]:
    schemas = json.loads(GATEWAY_SCHEMAS.read_text())
    return {kind: jsonschema.Draft202012Validator(schemas[kind]) for kind in ("GRPCRoute", "Gateway")}


@functools.cache
def podmonitor_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(PODMONITOR_SCHEMA.read_text())["PodMonitor"])


def errors_of(validator: jsonschema.protocols.Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def kube_validate(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(map(str, e.absolute_path))
        pytest.fail(f"{doc['kind']} {doc['metadata'].get('name')}: {path}: {e.message}")


# --------------------------------------------------------------------------- lint and render


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case: str) -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(case))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_renders_one_rayservice(case: str) -> None:
    docs = render(case)
    assert len(docs_of(docs, "RayService")) == 1
    for doc in docs:
        assert doc["metadata"]["name"].startswith(RELEASE)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


# --------------------------------------------------------------------------- schema validation


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_rayservice_matches_kuberay_crd(case: str) -> None:
    rs = rayservice(case)
    assert rs["apiVersion"] == "ray.io/v1"
    errors = errors_of(rayservice_validator(), rs)
    assert not errors, "\n".join(errors)


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_builtin_objects_validate_strictly(case: str) -> None:
    docs = render(case)
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith(("ray.io/", "gateway.networking.k8s.io/", "monitoring.coreos.com/")):
            continue
        kube_validate(doc)
        checked += 1
    assert checked >= 1
    # The Kubernetes objects inside the RayService are checked as what KubeRay makes of them.
    rs = rayservice(case)
    for name, _, tmpl in pod_templates(rs):
        kube_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": tmpl})
    kube_validate({"apiVersion": "v1", "kind": "Service", **rs["spec"]["serveService"]})


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_gateway_api_objects_validate(case: str) -> None:
    validators = gateway_validators()
    for doc in render(case):
        if doc["apiVersion"].startswith("gateway.networking.k8s.io/"):
            errors = errors_of(validators[doc["kind"]], doc)
            assert not errors, "\n".join(errors)


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_podmonitor_matches_the_prometheus_operator_crd(case: str) -> None:
    for doc in docs_of(render(case), "PodMonitor"):
        errors = errors_of(podmonitor_validator(), doc)
        assert not errors, "\n".join(errors)


def test_podmonitor_schema_rejects_what_the_crd_rejects() -> None:
    """The subset is not vacuous: fields, enums and patterns of the CRD bite."""
    base = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "m"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "podMetricsEndpoints": [{"port": "metrics"}]},
    }
    assert not errors_of(podmonitor_validator(), base)
    bad_endpoints: list[dict[str, Any]] = [
        {"port": "metrics", "interval": "30 seconds"},
        {"port": "metrics", "scheme": "ftp"},
        {"port": "metrics", "portNumber": 70000},
        {"port": "metrics", "relabelings": [{"action": "rewrite"}]},
        {"port": "metrics", "targetPortz": 1},
    ]
    for endpoint in bad_endpoints:
        doc = copy.deepcopy(base)
        doc["spec"]["podMetricsEndpoints"] = [endpoint]
        assert errors_of(podmonitor_validator(), doc), endpoint
    no_selector = copy.deepcopy(base)
    del no_selector["spec"]["selector"]
    assert errors_of(podmonitor_validator(), no_selector)


@needs_helm
def test_prometheus_scraping_reaches_every_replica_pod() -> None:
    case = "monitoring-values.yaml"
    values = yaml.safe_load((CHART / "ci" / case).read_text())
    port = values["metrics"]["prometheus"]["port"]
    docs = render(case)
    (monitor,) = docs_of(docs, "PodMonitor")
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["default"]}  # the release's namespace
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "hotloop-metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"
    selector = monitor["spec"]["selector"]["matchLabels"]
    rs = rayservice(case)
    scraped = 0
    for name, group, tmpl in pod_templates(rs):
        labels = tmpl["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), name
        (container,) = tmpl["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = env_of(container)
        # Only pods running replicas declare the port, so only they become targets.
        assert ("hotloop-metrics" in ports) == runs_replicas(name, group), name
        if runs_replicas(name, group):
            scraped += 1
            assert ports["hotloop-metrics"] == port
            assert env["OTEL_METRICS_EXPORTER"]["value"] == "prometheus"
            assert env["OTEL_EXPORTER_PROMETHEUS_PORT"]["value"] == str(port)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http://otel-collector")  # traces
    assert scraped == 2  # the head (runReplicas) and the cpu workers
    config = config_from_dict(serve_config(case)["applications"][0]["args"]["config"])
    assert config.telemetry.request_log == "json"


@needs_helm
def test_default_has_no_scraping_and_no_dashboard() -> None:
    docs = render("default")
    assert not docs_of(docs, "PodMonitor") and not docs_of(docs, "ConfigMap")
    for _, _, tmpl in pod_templates(rayservice("default")):
        (container,) = tmpl["spec"]["containers"]
        assert "hotloop-metrics" not in {p["name"] for p in container["ports"]}
        assert "OTEL_METRICS_EXPORTER" not in env_of(container)


@needs_helm
def test_grafana_dashboard_configmap_for_the_sidecar() -> None:
    (cm,) = docs_of(render("monitoring-values.yaml"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert cm["data"]["hotloop-serve.json"] == shipped.rstrip("\n")
    assert json.loads(cm["data"]["hotloop-serve.json"])["uid"] == "hotloop-serve"


def test_values_schema_is_closed_at_every_level() -> None:
    """Every object the values can hold lists its keys (additionalProperties: false) or, for
    maps (labels, worker groups by name), constrains every value; none accepts anything.
    Conditional subschemas (if/then under allOf) only add constraints to a closed object."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects: list[str] = []
    conditional = {"allOf", "anyOf", "oneOf", "if", "then", "else", "not"}

    def walk(node: Any, path: str, constraint: bool) -> None:
        if isinstance(node, dict):
            if not constraint and (node.get("type") == "object" or "properties" in node):
                ap = node.get("additionalProperties", True)
                if ap is True or ("properties" in node and ap is not False):
                    open_objects.append(path or "/")
            for key, value in node.items():
                walk(value, f"{path}/{key}", constraint or key in conditional)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}", constraint)

    walk(schema, "", False)
    assert not open_objects, f"objects that accept unknown keys: {open_objects}"


def _pydantic_node(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema node with $ref followed and Optional[...] unwrapped."""
    if "$ref" in node:
        return _pydantic_node(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[-1]])
    alternatives = [a for a in node.get("anyOf", []) if a.get("type") != "null"]
    if len(alternatives) == 1:
        return _pydantic_node(schema, alternatives[0])
    return node


def _pydantic_fields(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    node = _pydantic_node(schema, node)
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        node = _pydantic_node(schema, node["items"])
    props: dict[str, Any] = node.get("properties", {})
    return props


def _values_fields(node: dict[str, Any]) -> dict[str, Any]:
    types = node.get("type")
    if types == "array" or (isinstance(types, list) and "array" in types and "items" in node):
        return _values_fields(node.get("items", {}))
    props: dict[str, Any] = node.get("properties", {})
    return props


BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def test_hotloop_values_schema_mirrors_the_config_schema() -> None:
    """values.schema.json's `hotloop` accepts exactly the fields of hotloop_serve.config.Config
    (less server.host, which a pod fixes), with the same numeric bounds: a field added to or
    changed in one must be mirrored in the other."""
    pyd = Config.model_json_schema()
    values = json.loads((CHART / "values.schema.json").read_text())["properties"]["hotloop"]
    mismatches: list[str] = []

    def compare(p_node: dict[str, Any], v_node: dict[str, Any], path: str) -> None:
        p_fields = _pydantic_fields(pyd, p_node)
        v_fields = _values_fields(v_node)
        expected = set(p_fields) - ({"host"} if path == "server" else set())
        if set(v_fields) != expected:
            mismatches.append(f"{path or '<root>'}: chart {sorted(v_fields)} vs config {sorted(expected)}")
        for name in sorted(expected & set(v_fields)):
            sub = f"{path}.{name}" if path else name
            p_leaf = _pydantic_node(pyd, p_fields[name])
            for bound in BOUNDS:
                if bound in p_leaf and v_fields[name].get(bound) != p_leaf[bound]:
                    mismatches.append(
                        f"{sub}: {bound} {v_fields[name].get(bound)} in the chart, {p_leaf[bound]} in config"
                    )
            compare(p_fields[name], v_fields[name], sub)

    compare(pyd, values, "")
    assert not mismatches, "\n".join(mismatches)


# --------------------------------------------------------------------------- the serveConfigV2 contract


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_serve_config_contract(case: str) -> None:
    sc = serve_config(case)
    assert set(sc) == {"http_options", "grpc_options", "applications"}
    assert sc["http_options"]["host"] == "0.0.0.0"
    assert sc["http_options"]["port"] == 8000
    assert sc["grpc_options"]["port"] == 9000
    assert sc["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICERS
    apps = sc["applications"]
    assert apps
    configs = []
    for app in apps:
        assert set(app) == {"name", "route_prefix", "import_path", "args"}
        assert app["import_path"] == "hotloop_serve.serve.app:build_app"
        assert app["route_prefix"] == f"/{app['name']}"
        assert set(app["args"]) == {"model", "config"}
        assert app["args"]["model"] == app["name"]
        config = config_from_dict(app["args"]["config"])
        assert app["args"]["model"] in {m.name for m in config.models}
        assert config.server.host == "0.0.0.0"
        assert config.server.grpc_port == sc["grpc_options"]["port"]
        assert config.server.http_port == sc["http_options"]["port"]
        configs.append(app["args"]["config"])
    # one application per model, all with the same config document
    assert all(c == configs[0] for c in configs)
    assert sorted(a["name"] for a in apps) == sorted(m.name for m in config_from_dict(configs[0]).models)


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_serve_config_is_what_the_server_renders(case: str) -> None:
    """The chart renders the document hotloop_serve.serve.app.serve_config makes of the same
    config (the chart keeps the config as written; the server dumps it with its defaults)."""
    from hotloop_serve.serve.app import serve_config as server_serve_config

    chart = serve_config(case)
    config = config_from_dict(chart["applications"][0]["args"]["config"])
    expected = server_serve_config(config)
    if config.server.request_timeout_s is not None:
        # the CLI sets it on gRPCOptions (serve/runner.py); serve_config() does not carry it yet
        expected["grpc_options"].setdefault("request_timeout_s", config.server.request_timeout_s)
    for app in chart["applications"]:
        app["args"]["config"] = config_from_dict(app["args"]["config"]).model_dump(mode="json")
    assert chart == expected


@needs_helm
def test_default_serves_the_embedded_model() -> None:
    config = config_from_dict(serve_config("default")["applications"][0]["args"]["config"])
    assert [m.path for m in config.models] == ["embedded:gemma-3-270m"]
    docs = render("default")
    for _, _, tmpl in pod_templates(rayservice("default")):
        assert not tmpl["spec"].get("initContainers")
        assert "hotloop-models" not in {v["name"] for v in tmpl["spec"].get("volumes", [])}
    assert not docs_of(docs, "ConfigMap")


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_model_paths_are_on_mounted_volumes(case: str) -> None:
    rs = rayservice(case)
    config = config_from_dict(serve_config(case)["applications"][0]["args"]["config"])
    files = [m.path for m in config.models if not m.path.startswith("embedded:")]
    hosts = [(n, g, t) for n, g, t in pod_templates(rs) if runs_replicas(n, g)]
    assert hosts, "no pod runs replicas"
    for name, _, tmpl in hosts:
        (container,) = tmpl["spec"]["containers"]
        mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
        for path in files:
            assert path.startswith("/"), path
            assert any(path.startswith(m) for m in mounts), f"{name}: {path} is on no volume of {mounts}"


@needs_helm
def test_url_source_downloads_with_checksums() -> None:
    case = "url-values.yaml"
    values = yaml.safe_load((CHART / "ci" / case).read_text())
    wanted = values["modelSource"]["url"]["files"]
    docs = render(case)
    (cm,) = docs_of(docs, "ConfigMap")
    assert cm["data"]["fetch_model.py"] == (CHART / "files" / "fetch_model.py").read_text()
    for name, group, tmpl in pod_templates(rayservice(case)):
        if not runs_replicas(name, group):
            continue
        (init,) = tmpl["spec"]["initContainers"]
        env = env_of(init)
        assert json.loads(env["HOTLOOP_MODEL_FILES"]["value"]) == wanted
        assert env["HOTLOOP_FETCH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "model-download-token"
        annotation = tmpl["metadata"]["annotations"]["hotloop-serve/fetch-script-sha256"]
        assert annotation == hashlib.sha256(cm["data"]["fetch_model.py"].encode()).hexdigest()


@needs_helm
def test_auth_tokens_and_session_secret_come_from_secrets() -> None:
    case = "ingress-tls-values.yaml"
    rs = rayservice(case)
    config = config_from_dict(serve_config(case)["applications"][0]["args"]["config"])
    assert config.auth.tokens_file == "/etc/hotloop/auth/tokens"
    assert config.auth.session_secret_env == "HOTLOOP_SESSION_SECRET"
    for _, _, tmpl in pod_templates(rs):
        (container,) = tmpl["spec"]["containers"]
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "hotloop-tokens"]
        assert mount["readOnly"] is True
        assert f"{mount['mountPath']}/tokens" == config.auth.tokens_file
        assert volumes["hotloop-tokens"]["secret"]["secretName"] == "hotloop-tokens"
        ref = env_of(container)["HOTLOOP_SESSION_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "hotloop-session", "key": "secret"}
    # an existing session Secret is used as is; none is generated
    assert not docs_of(render(case), "Secret")


@needs_helm
def test_default_generates_one_shared_session_secret() -> None:
    docs = render("default")
    (secret,) = docs_of(docs, "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = secret["metadata"]["name"]
    for _, _, tmpl in pod_templates(rayservice("default")):
        (container,) = tmpl["spec"]["containers"]
        ref = env_of(container)["HOTLOOP_SESSION_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == key and ref["key"] in secret["data"]


@needs_helm
@pytest.mark.parametrize("case", CASES)
def test_serve_service_exposes_grpc_and_http(case: str) -> None:
    rs = rayservice(case)
    ports = {p["name"]: p for p in rs["spec"]["serveService"]["spec"]["ports"]}
    assert ports["serve"]["port"] == 8000
    assert ports["serve-grpc"]["port"] == 9000
    assert ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # KubeRay (>= 1.6) builds the serve Service from head-container ports named serve / serve-*
    (head,) = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert head_ports["serve"] == 8000
    assert head_ports["serve-grpc"] == 9000


@needs_helm
def test_ingress_and_grpcroute_reach_the_grpc_port() -> None:
    docs = render("ingress-tls-values.yaml")
    serve_svc = rayservice("ingress-tls-values.yaml")["spec"]["serveService"]["metadata"]["name"]
    (ingress,) = docs_of(docs, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert ingress["spec"]["tls"] == [{"hosts": ["chat.example.com"], "secretName": "chat-example-com-tls"}]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": serve_svc, "port": {"name": "serve-grpc"}}
    (route,) = docs_of(docs, "GRPCRoute")
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": serve_svc, "port": 9000}]
    (gateway,) = docs_of(docs, "Gateway")
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTPS"
    assert listener["tls"]["certificateRefs"][0]["name"] == "grpc-example-com-tls"
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"], "sectionName": listener["name"]}]


@needs_helm
def test_gpu_workers() -> None:
    rs = rayservice("gpu-values.yaml")
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu"}
    spec = groups["gpu"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":0.1.0-cuda")
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (init,) = spec["initContainers"]
    assert init["image"] == "registry.example.com/models/qwen2.5-7b-instruct-gguf:q4_k_m"
    (head,) = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert not head["image"].endswith("-cuda")


@needs_helm
def test_worker_pods_are_sized_from_the_models() -> None:
    rs = rayservice("url-values.yaml")
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    # 2 replicas per pod x (2 CPUs, 1.5 GiB) + 1 GiB overhead, over the ~70% Ray leaves to tasks;
    # the CPU has half a core more for Ray's own processes, which Ray does not schedule on
    assert resources["requests"] == resources["limits"] == {"cpu": "4500m", "memory": "5852Mi"}
    assert group["rayStartParams"] == {"num-cpus": "4"}


@needs_helm
def test_rays_own_processes_get_cpu_beyond_the_replicas_cores(tmp_path: Path) -> None:
    """``sizing.podCpuOverhead`` is pod quota that Ray never hands to a replica: Ray's
    ``num-cpus`` stays the replicas' cores (rounded up, as KubeRay rounds a limit), an explicit
    ``num-cpus`` or explicit ``resources`` are the user's, and 0 turns the overhead off."""

    def worker(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        result = render_values(values, tmp_path)
        assert result.returncode == 0, result.stderr
        (rs,) = docs_of(tuple(d for d in yaml.safe_load_all(result.stdout) if d), "RayService")
        (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        return group["rayStartParams"], group["template"]["spec"]["containers"][0]["resources"]["limits"]

    fraction = {"hotloop": {"models": [{**BASE_MODEL, "resources": {"num_cpus": 1.5}}]}}
    params, limits = worker(fraction)
    assert (params, limits["cpu"]) == ({"num-cpus": "2"}, "2")
    params, limits = worker({**fraction, "sizing": {"podCpuOverhead": 0}})
    assert (params, limits["cpu"]) == ({"num-cpus": "2"}, "1500m")
    params, limits = worker({**fraction, "sizing": {"podCpuOverhead": "1"}})
    assert (params, limits["cpu"]) == ({"num-cpus": "2"}, "2500m")
    own = {"cpu": {"rayStartParams": {"num-cpus": 3, "block": True}}}
    params, limits = worker({**fraction, "workerGroups": own})
    assert (params, limits["cpu"]) == ({"num-cpus": "3", "block": "true"}, "2")
    sized = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "3", "memory": "4Gi"}}
    explicit = {"cpu": {"resources": sized}}
    params, limits = worker({**fraction, "workerGroups": explicit})
    assert (params, limits["cpu"]) == ({}, "3")


@needs_helm
def test_llama_threads_follow_each_models_num_cpus(tmp_path: Path) -> None:
    """Each replica decodes with its own reservation's threads, not the whole pod's CPU limit
    (``replicasPerPod`` replicas share one pod); a model's own ``engine.threads`` wins, 0 included."""
    values = {
        "hotloop": {
            "models": [
                {**BASE_MODEL, "name": "default-cpus"},
                {**BASE_MODEL, "name": "three", "resources": {"num_cpus": 3}},
                {**BASE_MODEL, "name": "fraction", "resources": {"num_cpus": 1.5}},
                {**BASE_MODEL, "name": "half", "resources": {"num_cpus": 0.5}},
                {**BASE_MODEL, "name": "own", "resources": {"num_cpus": 4}, "engine": {"threads": 2}},
                {**BASE_MODEL, "name": "auto", "resources": {"num_cpus": 4}, "engine": {"threads": 0}},
            ]
        },
        "workerGroups": {"cpu": {"replicasPerPod": 2}},
    }
    result = render_values(values, tmp_path)
    assert result.returncode == 0, result.stderr
    (rs,) = docs_of(tuple(d for d in yaml.safe_load_all(result.stdout) if d), "RayService")
    raw = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    threads = {m.name: m.engine.threads for m in config_from_dict(raw).models}
    assert threads == {"default-cpus": 1, "three": 3, "fraction": 1, "half": 1, "own": 2, "auto": 0}


@needs_helm
def test_autoscaling_turns_on_the_ray_autoscaler() -> None:
    cluster = rayservice("autoscaling-values.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] == {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative"}
    assert rayservice("default")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False


@needs_helm
def test_otel_environment() -> None:
    for name, _, tmpl in pod_templates(rayservice("autoscaling-values.yaml")):
        env = env_of(tmpl["spec"]["containers"][0])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability.svc:4317", name
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
        assert env["OTEL_EXPORTER_OTLP_INSECURE"]["value"] == "true"
        assert "deployment.environment=staging" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    env = env_of(
        rayservice("default")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    )
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    headers = env_of(
        rayservice("ingress-tls-values.yaml")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
            "containers"
        ][0]
    )["OTEL_EXPORTER_OTLP_HEADERS"]
    assert headers["valueFrom"]["secretKeyRef"] == {"name": "otlp-auth", "key": "headers"}


@needs_helm
def test_the_proxy_message_limit_follows_the_largest_request_limit(tmp_path: Path) -> None:
    from hotloop_serve.config import config_from_dict
    from hotloop_serve.serve.app import proxy_message_limit, replica_message_limit

    for name, _, tmpl in pod_templates(rayservice("default")):
        env = env_of(tmpl["spec"]["containers"][0])
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == str(4194304 + 65536), name
        assert env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]["value"] == str(4194304 + 131072), name
    models = [
        {"name": "a", "limits": {"max_request_bytes": 1 << 20}},
        {"name": "b", "limits": {"max_request_bytes": 16 << 20}},
    ]
    result = render_values({"hotloop": {"models": models}}, tmp_path)
    assert result.returncode == 0, result.stderr
    (rs,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "RayService"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    config = config_from_dict({"models": models})
    assert env_of(head)["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == str(proxy_message_limit(config))
    assert env_of(head)["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]["value"] == str(replica_message_limit(config))


@needs_helm
def test_every_ray_pod_runs_serve_as_the_local_server_does() -> None:
    from hotloop_serve.serve.runner import RAY_SERVE_ENV

    for name, _, tmpl in pod_templates(rayservice("default")):
        env = env_of(tmpl["spec"]["containers"][0])
        assert {k: env[k]["value"] for k in RAY_SERVE_ENV} == RAY_SERVE_ENV, name


@needs_helm
def test_pod_disruption_budget_selects_the_workers() -> None:
    (pdb,) = docs_of(render("default"), "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    for name, _, tmpl in pod_templates(rayservice("default")):
        labels = tmpl["metadata"]["labels"]
        matches = all(labels.get(k) == v for k, v in selector.items())
        assert matches == (name != "head"), name


@needs_helm
def test_image_volume_source(tmp_path: Path) -> None:
    values = {
        "modelSource": {
            "type": "image",
            "image": {"repository": "registry.example.com/models/m", "tag": "v1", "mode": "volume", "path": "/gguf"},
        },
        "hotloop": {"models": [{"name": "m", "path": "m.gguf"}]},
    }
    result = render_values(values, tmp_path)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (rs,) = docs_of(tuple(docs), "RayService")
    assert not errors_of(rayservice_validator(), rs)
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = group["template"]["spec"]
    kube_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"}, "template": group["template"]})
    assert "initContainers" not in spec
    (volume,) = [v for v in spec["volumes"] if v["name"] == "hotloop-models"]
    assert volume["image"]["reference"] == "registry.example.com/models/m:v1"
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "hotloop-models"]
    assert mount["subPath"] == "gguf"


def _replica_pods(rs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(n, t["spec"]) for n, g, t in pod_templates(rs) if runs_replicas(n, g)]


@needs_helm
def test_session_persistence_on_a_claim_the_chart_creates() -> None:
    case = "sessions-values.yaml"
    docs = render(case)
    (pvc,) = docs_of(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == f"{RELEASE}-hotloop-serve-sessions"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "standard-rwx",
        "resources": {"requests": {"storage": "24Gi"}},
    }
    rs = rayservice(case)
    pods = _replica_pods(rs)
    assert pods
    for name, spec in pods:
        (volume,) = [v for v in spec["volumes"] if v["name"] == "hotloop-sessions"]
        assert volume["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"]}, name
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "hotloop-sessions"]
        assert mount == {"name": "hotloop-sessions", "mountPath": "/var/lib/hotloop/sessions"}, name
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "hotloop-sessions" not in {v["name"] for v in head.get("volumes", [])}, "the head runs no replicas"
    # Each model's disk tier: its own directory on the claim (a relative persist_dir under it).
    config = config_from_dict(serve_config(case)["applications"][0]["args"]["config"])
    assert {m.name: m.engine.persist_dir for m in config.models} == {
        "gemma-3-270m": "/var/lib/hotloop/sessions/gemma-3-270m",
        "gemma-small": "/var/lib/hotloop/sessions/small",
    }
    assert [m.engine.persist_bytes for m in config.models] == [16 * 2**30, 4 * 2**30]


@needs_helm
def test_session_persistence_on_an_existing_claim(tmp_path: Path) -> None:
    values = {
        "sessionPersistence": {
            "enabled": True,
            "existingClaim": "kv-sessions",
            "subPath": "hotloop",
            "mountPath": "/s/",
        },
        "hotloop": {
            "models": [
                {**BASE_MODEL, "name": "a"},
                {**BASE_MODEL, "name": "b", "engine": {"persist_dir": "/elsewhere/b"}},
            ]
        },
        "head": {"runReplicas": True, "resources": {"requests": {"cpu": "4", "memory": "8Gi"}}},
    }
    result = render_values(values, tmp_path)
    assert result.returncode == 0, result.stderr
    docs = tuple(d for d in yaml.safe_load_all(result.stdout) if d)
    assert not docs_of(docs, "PersistentVolumeClaim"), "an existing claim is used, not created"
    (rs,) = docs_of(docs, "RayService")
    assert not errors_of(rayservice_validator(), rs)
    pods = _replica_pods(rs)
    assert {n for n, _ in pods} == {"head", "cpu"}
    for name, spec in pods:
        (volume,) = [v for v in spec["volumes"] if v["name"] == "hotloop-sessions"]
        assert volume["persistentVolumeClaim"]["claimName"] == "kv-sessions", name
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "hotloop-sessions"]
        assert (mount["mountPath"], mount["subPath"]) == ("/s/", "hotloop")
    raw = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    config = config_from_dict(raw)
    # An absolute persist_dir is the user's choice and kept as is.
    assert [m.engine.persist_dir for m in config.models] == ["/s/a", "/elsewhere/b"]


@needs_helm
def test_default_has_no_session_persistence() -> None:
    assert not docs_of(render("default"), "PersistentVolumeClaim")
    config = config_from_dict(serve_config("default")["applications"][0]["args"]["config"])
    assert all(m.engine.persist_dir == "" for m in config.models)
    for name, spec in _replica_pods(rayservice("default")):
        assert "hotloop-sessions" not in {v["name"] for v in spec.get("volumes", [])}, name


@needs_helm
def test_notes_tell_how_to_reach_the_service() -> None:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", *values_args("autoscaling-values.yaml"))
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{RELEASE}-hotloop-serve-serve-svc 9000:9000" in notes
    assert "application: gemma-3-270m" in notes
    assert "authorization: Bearer" in notes


# --------------------------------------------------------------------------- bad values

BASE_MODEL: dict[str, Any] = {"name": "m", "path": "embedded:gemma-3-270m"}

# Rejected by values.schema.json: `helm lint --strict` (and install/template) fail.
SCHEMA_ERRORS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "negative worker replicas",
        {"workerGroups": {"cpu": {"replicas": -1}}},
        ["/workerGroups/cpu/replicas", "minimum"],
    ),
    ("zero model replicas", {"hotloop": {"models": [{**BASE_MODEL, "replicas": 0}]}}, ["/hotloop/models/0/replicas"]),
    ("unknown top-level key", {"replicas": 3}, ["additional properties 'replicas' not allowed"]),
    ("unknown worker key", {"workerGroups": {"cpu": {"replica": 2}}}, ["/workerGroups/cpu", "'replica' not allowed"]),
    (
        "unknown engine key",
        {"hotloop": {"models": [{**BASE_MODEL, "engine": {"hot_session": 4}}]}},
        ["/hotloop/models/0/engine", "'hot_session' not allowed"],
    ),
    ("server.host is the pod's", {"hotloop": {"server": {"host": "127.0.0.1"}}}, ["/hotloop/server", "'host'"]),
    ("wrong type", {"hotloop": {"models": [{**BASE_MODEL, "replicas": "two"}]}}, ["/hotloop/models/0/replicas"]),
    ("bad model name", {"hotloop": {"models": [{**BASE_MODEL, "name": "My_Model"}]}}, ["/hotloop/models/0/name"]),
    ("gpu count", {"workerGroups": {"cpu": {"gpus": -1}}}, ["/workerGroups/cpu/gpus"]),
    ("bad quantity", {"head": {"resources": {"requests": {"memory": "lots"}}}}, ["/head/resources/requests/memory"]),
    ("pvc without claim", {"modelSource": {"type": "pvc"}}, ["/modelSource/pvc/claimName"]),
    (
        "bad sha256",
        {
            "modelSource": {
                "type": "url",
                "url": {"files": [{"url": "https://x/m.gguf", "sha256": "abc", "filename": "m"}]},
            }
        },
        ["/modelSource/url/files/0/sha256"],
    ),
    ("ingress without host", {"ingress": {"enabled": True}}, ["/ingress"]),
    ("bad scrape interval", {"metrics": {"podMonitor": {"interval": "30 seconds"}}}, ["/metrics/podMonitor/interval"]),
    (
        "bad relabel action",
        {"metrics": {"podMonitor": {"relabelings": [{"action": "rewrite"}]}}},
        ["/metrics/podMonitor/relabelings/0/action"],
    ),
    (
        "bad kv layout",
        {"hotloop": {"models": [{**BASE_MODEL, "engine": {"kv_layout": "paged"}}]}},
        ["/hotloop/models/0/engine/kv_layout"],
    ),
    ("bad request log format", {"hotloop": {"telemetry": {"request_log": "xml"}}}, ["/hotloop/telemetry/request_log"]),
    (
        "relative sessions mount",
        {"sessionPersistence": {"enabled": True, "mountPath": "sessions"}},
        ["/sessionPersistence/mountPath"],
    ),
    (
        "bad sessions access mode",
        {"sessionPersistence": {"enabled": True, "accessModes": ["ReadWriteAll"]}},
        ["/sessionPersistence/accessModes/0"],
    ),
    ("bad sessions size", {"sessionPersistence": {"size": "lots"}}, ["/sessionPersistence/size"]),
]

# Cross-field checks the schema cannot express, made by the templates (`fail`): helm template /
# install fail; helm 4's lint prints the message but, in its lint mode, only at INFO level.
TEMPLATE_ERRORS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "synthetic engine not allowed",
        {"hotloop": {"models": [{**BASE_MODEL, "engine": {"kind": "synthetic"}}]}},
        ["hotloop.models[0].engine.kind", "synthetic", "allowSyntheticEngine"],
    ),
    (
        "autoscaling min > max",
        {"hotloop": {"models": [{**BASE_MODEL, "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]}},
        ["hotloop.models[0].autoscaling", "min_replicas (3) > max_replicas (2)"],
    ),
    (
        "session context over the context",
        {"hotloop": {"models": [{**BASE_MODEL, "engine": {"context_tokens": 4096}}]}},
        ["hotloop.models[0].engine", "session_context_tokens (8192) > context_tokens (4096)"],
    ),
    (
        "duplicate model names",
        {"hotloop": {"models": [BASE_MODEL, BASE_MODEL]}},
        ["hotloop.models[1].name", "used twice"],
    ),
    (
        "relative path without a model source",
        {"hotloop": {"models": [{**BASE_MODEL, "path": "model.gguf"}]}},
        ["hotloop.models[0].path", "modelSource.type is embedded"],
    ),
    (
        "url source without the file",
        {
            "modelSource": {
                "type": "url",
                "url": {"files": [{"url": "https://x/a.gguf", "sha256": "0" * 64, "filename": "a.gguf"}]},
            },
            "hotloop": {"models": [{**BASE_MODEL, "path": "b.gguf"}]},
        },
        ["hotloop.models[0].path", "b.gguf", "modelSource.url.files"],
    ),
    (
        "model bigger than every pod",
        {
            "workerGroups": {"cpu": {"resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}},
            "hotloop": {"models": [{**BASE_MODEL, "resources": {"num_cpus": 2, "memory_bytes": 8 * 2**30}}]},
        },
        ["hotloop.models[0].resources", "fits no pod", "workerGroups.cpu"],
    ),
    (
        "gpu model without gpu workers",
        {"hotloop": {"models": [{**BASE_MODEL, "resources": {"num_gpus": 1}}]}},
        ["hotloop.models[0].resources", "num_gpus 1", "fits no pod"],
    ),
    (
        "podMonitor without the exporter",
        {"metrics": {"podMonitor": {"enabled": True}}},
        ["metrics.podMonitor.enabled", "metrics.prometheus.enabled"],
    ),
    (
        "no pod runs replicas",
        {"workerGroups": {"cpu": {"enabled": False}}},
        ["no pod runs model replicas"],
    ),
    (
        "sessions claim smaller than the disk budgets",
        {
            "sessionPersistence": {"enabled": True, "size": "10Gi"},
            "hotloop": {"models": [{**BASE_MODEL, "name": "a"}, {**BASE_MODEL, "name": "b"}]},
        },
        ["sessionPersistence.size 10Gi", "engine.persist_bytes", "17179869184 bytes"],
    ),
    (
        "sessions on the model volume",
        {
            "sessionPersistence": {"enabled": True, "mountPath": "/models"},
            "modelSource": {"type": "pvc", "pvc": {"claimName": "m"}},
            "hotloop": {"models": [{**BASE_MODEL, "path": "m.gguf"}]},
        },
        ["sessionPersistence.mountPath", "modelSource.mountPath"],
    ),
]


@needs_helm
@pytest.mark.parametrize(
    ("values", "expected"), [(v, e) for _, v, e in SCHEMA_ERRORS], ids=[n for n, _, _ in SCHEMA_ERRORS]
)
def test_bad_values_fail_lint_naming_the_value(values: dict[str, Any], expected: list[str], tmp_path: Path) -> None:
    result = lint_values(values, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for text in expected:
        assert text in output, f"{text!r} not in:\n{output}"


@needs_helm
@pytest.mark.parametrize(
    ("values", "expected"), [(v, e) for _, v, e in TEMPLATE_ERRORS], ids=[n for n, _, _ in TEMPLATE_ERRORS]
)
def test_inconsistent_values_fail_rendering_naming_the_value(
    values: dict[str, Any], expected: list[str], tmp_path: Path
) -> None:
    result = render_values(values, tmp_path)
    assert result.returncode != 0, result.stdout
    lint = lint_values(values, tmp_path)
    for text in expected:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
        assert text in lint.stdout + lint.stderr


ENGINE_VARIANTS: list[dict[str, Any]] = [
    {},
    {"context_tokens": 4096},
    {"context_tokens": 4096, "session_context_tokens": 4096},
    {"hot_sessions": 16, "batch_tokens": 8},
    {"prefill_chunk": 1024},
    {"prefill_chunk": 1024, "batch_tokens": 2048},
    {"max_sessions": 4},
    {"max_sessions": 4, "hot_sessions": 4},
]


@needs_helm
@pytest.mark.parametrize("engine", ENGINE_VARIANTS, ids=[json.dumps(e) for e in ENGINE_VARIANTS])
def test_chart_engine_checks_agree_with_the_config(engine: dict[str, Any], tmp_path: Path) -> None:
    """The chart rejects at install time exactly the engine options the server would reject at start."""
    model = {**BASE_MODEL, "engine": engine}
    try:
        config_from_dict({"models": [model]})
        valid = True
    except ValueError:
        valid = False
    result = render_values({"hotloop": {"models": [model]}}, tmp_path)
    assert (result.returncode == 0) == valid, result.stderr


@needs_helm
def test_synthetic_engine_renders_only_when_allowed(tmp_path: Path) -> None:
    """The load generator reaches serveConfigV2 only with the explicit allowSyntheticEngine."""
    model = {**BASE_MODEL, "engine": {"kind": "synthetic", "synthetic_step_ms": 15}}
    result = render_values({"allowSyntheticEngine": True, "hotloop": {"models": [model]}}, tmp_path)
    assert result.returncode == 0, result.stderr
    (rs,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "RayService"]
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]
    assert config_from_dict(args).model("m").engine.kind == "synthetic"


# --------------------------------------------------------------------------- the download script


def _run_fetch(directory: Path, files: list[dict[str, str]]) -> subprocess.CompletedProcess[str]:
    env = {"HOTLOOP_MODEL_DIR": str(directory), "HOTLOOP_MODEL_FILES": json.dumps(files), "PATH": os.environ["PATH"]}
    script = CHART / "files" / "fetch_model.py"
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def test_fetch_script_verifies_sha256(tmp_path: Path) -> None:
    source = tmp_path / "source.gguf"
    source.write_bytes(os.urandom(3 << 20))
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    dest = tmp_path / "models"
    spec = {"url": source.as_uri(), "sha256": digest, "filename": "m.gguf"}

    first = _run_fetch(dest, [spec])
    assert first.returncode == 0, first.stderr
    assert (dest / "m.gguf").read_bytes() == source.read_bytes()
    again = _run_fetch(dest, [spec])
    assert again.returncode == 0 and "present, sha256 ok" in again.stdout

    bad = _run_fetch(dest, [{**spec, "sha256": "0" * 64, "filename": "bad.gguf"}])
    assert bad.returncode != 0
    assert "sha256 mismatch" in bad.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["m.gguf"]  # nothing partial left behind


# --------------------------------------------------------------------------- container images


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_install_the_project_with_the_pinned_llama_cpp(name: str) -> None:
    text = (ROOT / "docker" / name).read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = next(line.strip().strip('",') for line in pyproject.splitlines() if '"llama-cpp-python==' in line)
    assert pin.split("==")[1] in text, f"{name} must build {pin}"
    assert "rayproject/ray:2.60.0-py311" in text
    assert "./clients/python" in text
    assert "CMAKE_ARGS" in text
    if name.endswith(".cuda"):
        assert "-DGGML_CUDA=on" in text
