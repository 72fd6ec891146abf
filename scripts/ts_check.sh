#!/usr/bin/env bash
# Checks of the TypeScript client (clients/typescript), from the repository root:
#   1. npm ci: the pinned dependencies of package-lock.json (registry packages only; the buf
#      CLI comes as a platform package, no install script downloads anything);
#   2. npm run check-gen: src/gen/ matches what ts-proto generates from protos/ now;
#   3. npm run build: tsc, strict, of the client and its tests;
#   4. npm test: node's test runner; unit tests against an in-process fake server, then
#      integration tests that start a real hotloop-serve (.venv/bin/hotloop-serve) on loopback
#      (HOTLOOP_ADDRESS=host:port uses a running server; HOTLOOP_SERVE_BIN another binary).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../clients/typescript"

command -v npm >/dev/null || { echo "ts_check: npm not found (Node.js >= 20 is needed)" >&2; exit 1; }
step() {
    local t0=$SECONDS
    echo "== ts_check: $*"
    "$@"
    echo "== ts_check: $* ($((SECONDS - t0)) s)"
}
step npm ci --no-audit --no-fund
step npm run check-gen
step npm run build
step npm test
