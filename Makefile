# The two commands of the README: `make chat` and `make test`.
.PHONY: chat test setup lint protos check-protos bench

setup:
	./scripts/setup.sh

chat: setup  ## serve the embedded default model and chat with it in the terminal
	.venv/bin/hotloop-serve run --chat

test: setup  ## every test: unit (tiny GGUF), integration (Ray + gRPC + Gemma), lint, stubs
	.venv/bin/python scripts/gen_protos.py --check
	.venv/bin/ruff check hotloop_serve clients/python/hotloop_client tests bench scripts
	.venv/bin/mypy
	.venv/bin/python -m pytest -q

protos: setup
	.venv/bin/python scripts/gen_protos.py

bench: setup
	.venv/bin/python bench/engine.py
