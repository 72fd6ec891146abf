#!/usr/bin/env bash
# Offline checks of the Helm chart helm/hotloop-serve, from the repository root:
#   1. fetch the pinned helm binary into tools/ (scripts/fetch_helm.sh; $HELM overrides);
#   2. helm lint --strict and helm template for the default values and every ci/*.yaml;
#   3. pytest tests/helm: KubeRay CRD + kubernetes-validate (strict, 1.33) validation of every
#      rendered object, the serveConfigV2 contract (config_from_dict), bad values rejected.
# HELM_CHECK_PYTEST=0 skips step 3 (when the main pytest run already covers tests/helm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

KUBE_VERSION=1.33.0
CHART=helm/hotloop-serve
PY=${PYTHON:-.venv/bin/python}
HELM=${HELM:-$(scripts/fetch_helm.sh)}
export HELM

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Keep helm away from the user's config, caches and any cluster.
export HELM_CONFIG_HOME="$work/config" HELM_CACHE_HOME="$work/cache" HELM_DATA_HOME="$work/data"
export KUBECONFIG="$work/no-kubeconfig"

echo "helm: $HELM ($("$HELM" version --short))"
failed=0
for values in default "$CHART"/ci/*.yaml; do
    args=()
    [ "$values" = default ] || args=(-f "$values")
    if ! "$HELM" lint --strict --kube-version "$KUBE_VERSION" "$CHART" "${args[@]}" >"$work/lint.log" 2>&1; then
        echo "FAIL helm lint --strict ($values):"; cat "$work/lint.log"; failed=1; continue
    fi
    if ! "$HELM" template hotloop-serve "$CHART" --kube-version "$KUBE_VERSION" \
        --api-versions ray.io/v1 --api-versions gateway.networking.k8s.io/v1 \
        "${args[@]}" >"$work/rendered.yaml" 2>"$work/template.log"; then
        echo "FAIL helm template ($values):"; cat "$work/template.log"; failed=1; continue
    fi
    echo "ok   lint --strict + template: $values ($(grep -c '^kind:' "$work/rendered.yaml") objects)"
done
[ "$failed" = 0 ] || exit 1

if [ "${HELM_CHECK_PYTEST:-1}" != 0 ]; then
    "$PY" -m pytest -q -p no:cacheprovider tests/helm
fi
