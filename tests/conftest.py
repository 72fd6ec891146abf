"""Shared fixtures: model files (a tiny generated GGUF, the bundled Gemma) and free ports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_gguf import write_tiny_gguf

from hotloop_serve.serve.probe import free_port

__all__ = ["free_port"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    from hotloop_serve.serve.model_source import embedded_model_path

    return embedded_model_path(progress=False)
