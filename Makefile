# The two commands of the README: `make chat` and `make test`.
.PHONY: chat test setup lint protos bench

setup:
	./scripts/setup.sh

chat: setup  ## serve the embedded default model and chat with it in the terminal
	.venv/bin/hotloop-serve run --chat

lint: setup  ## generated stubs and sync client fresh, ruff, mypy
	.venv/bin/python scripts/gen_protos.py --check
	.venv/bin/python scripts/gen_sync_client.py --check
	.venv/bin/ruff check hotloop_serve clients/python/hotloop_client tests bench scripts
	.venv/bin/ruff format --check hotloop_serve clients/python/hotloop_client tests bench scripts
	.venv/bin/mypy

test: lint  ## everything: lint, Helm chart offline checks, Python tests (unit + integration), TypeScript client
	HELM_CHECK_PYTEST=0 ./scripts/helm_check.sh
	.venv/bin/python -m pytest -q
	./scripts/ts_check.sh

protos: setup
	.venv/bin/python scripts/gen_protos.py

bench: setup  ## engine, affinity and peer benchmarks (prints tables, writes bench/results/)
	.venv/bin/python bench/invariance.py
	.venv/bin/python bench/engine.py
	.venv/bin/python bench/affinity.py
	.venv/bin/python bench/peer.py
