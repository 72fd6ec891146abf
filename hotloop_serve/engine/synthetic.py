"""A synthetic engine: the real :class:`Engine` with llama.cpp's decoding replaced by a clock.

A load generator for the serving layer (``engine.kind: synthetic``), never a model: it answers
every prompt with text cycled from a fixed vocabulary. What an accelerator replica emits
(thousands of tokens per second across 64-256 sessions) cannot be produced by llama.cpp on a
few CPU cores, yet that is the rate at which the serving layer (servicer, Ray's proxy, the
SDKs) must keep up; this engine produces it on any machine, so the serving layer's cost per
token can be measured and bounded (``bench/serving.py``, ``docs/capacity.md``).

Only the three llama.cpp pieces are replaced; sessions, the scheduler, KV accounting
(admission, eviction to RAM, pre-emption), streams and sample limits are the real ones:

- :class:`SyntheticRunner`: each step sleeps until ``synthetic_step_ms`` after the previous
  step began (the engine's own bookkeeping runs inside that time, as a host overlaps an
  accelerator's kernels; a step whose bookkeeping runs longer starts late, and the rate drops,
  as it would there) and asks for one token per decoding session: one step's batch is as wide
  as ``hot_sessions``.
- :class:`SyntheticMemory`: KV "cells" counted per sequence, saved and restored as a few bytes.
- :class:`SyntheticOutput`: the next token of the fixed vocabulary, never an end of
  generation, so a reply runs to its ``sample_len`` (or the session's window).

The model file is still read, vocabulary only (no weights): prompts are tokenized and
rendered by its real tokenizer and chat template, and streamed text is real token text.
Grammars and tools are accepted and ignored (the text does not follow them).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.output import Outcome, OutputProcessor
from hotloop_serve.engine.requests import Request
from hotloop_serve.engine.runner import Logits, StepOutput
from hotloop_serve.engine.scheduler import Piece
from hotloop_serve.engine.session import KVBytes

__all__ = ["VOCABULARY_TEXT", "SyntheticMemory", "SyntheticOutput", "SyntheticRunner", "open_engine"]

VOCABULARY_TEXT = (
    " lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut"
    " labore et dolore magna aliqua."
)
"""The text a synthetic reply cycles through, as the model's tokens (no end-of-generation among them)."""

_HEADER = 4
"""Bytes of a saved synthetic state that hold its cell count (the rest pads it to a plausible size)."""
_BYTES_PER_CELL = 16
"""Saved bytes per cell: keeps the RAM tier's accounting meaningful without holding real KV."""
_NO_ROW = np.zeros(0, dtype=np.float32)


class SyntheticMemory:
    """Cells per sequence, always contiguous from position 0 (what the KV manager keeps them)."""

    def __init__(self) -> None:
        self.cells: dict[int, int] = {}
        self.calibrated = threading.Event()
        self.calibrated.set()
        self.layout = None
        """No state layout to check imports against: a synthetic state is its cell count."""

    @property
    def n_swa(self) -> int:
        return 0

    @property
    def partial_ok(self) -> bool:
        return True

    def calibrate(self) -> None:
        """Nothing to learn (the real memory learns its state layout here)."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        n = self.cells.get(seq, 0)
        if p1 < 0 or p1 >= n:  # a cut of the tail (the only kind the KV manager makes)
            self.cells[seq] = min(n, max(p0, 0))
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        end = self.cells.get(src, 0) if p1 < 0 else min(p1, self.cells.get(src, 0))
        self.cells[dst] = max(self.cells.get(dst, 0), end)

    def window_cells(self, seq: int) -> int:
        return 0

    def save(self, seq: int) -> KVBytes | None:
        n = self.cells.get(seq, 0)
        data = (ctypes.c_uint8 * (_HEADER + _BYTES_PER_CELL * n))()
        data[:_HEADER] = list(n.to_bytes(_HEADER, "little"))
        return data

    def restore(self, seq: int, data: KVBytes) -> bool:
        if len(data) < _HEADER:
            return False
        n = int.from_bytes(bytes(data[:_HEADER]), "little")
        if len(data) != _HEADER + _BYTES_PER_CELL * n:
            return False
        self.cells[seq] = n
        return True

    def put(self, pieces: Sequence[Piece]) -> None:
        """The step's tokens are now cached."""
        cells = self.cells
        for p in pieces:
            cells[p.seq] = p.pos + len(p.tokens)


class SyntheticRunner:
    """Runs a step by waiting out its step time; one row of (empty) logits per piece that asks."""

    ctx = None
    """No llama.cpp context: the synthetic output stage samples nothing."""

    def __init__(self, model: Model, opts: EngineOptions) -> None:
        self.model = model
        self.step_s = opts.synthetic_step_ms / 1e3
        self.memory = SyntheticMemory()
        self._end = 0.0
        """When the previous step ended (perf_counter)."""

    def execute(self, pieces: Sequence[Piece]) -> StepOutput:
        now = time.perf_counter()
        # Back to back, a step began when the previous one ended; after an idle gap, now.
        start = self._end if now - self._end < self.step_s else now
        end = start + self.step_s
        if end > now:
            time.sleep(end - now)
        self._end = max(end, now)
        self.memory.put(pieces)
        logits = tuple(Logits(i, _NO_ROW) if p.logits else None for i, p in enumerate(pieces))
        return StepOutput(self.step_s, logits, tuple(len(p.tokens) for p in pieces))

    def close(self) -> None:
        """Nothing to free."""


class SyntheticOutput(OutputProcessor):
    """The next token of the fixed vocabulary; the reply ends only on its limits or a stop string."""

    def __init__(self, model: Model, vocabulary: Sequence[int]) -> None:
        super().__init__(model, None)
        self.vocabulary = tuple(vocabulary)
        # Rendered once: the hot path then does a tuple index and the text assembler's work.
        self.pieces = tuple(model.piece(t) for t in self.vocabulary)

    def process(self, req: Request, logits: Logits) -> Outcome:
        n = req.generated
        if n == 0:
            req.t_first = time.perf_counter()
        req.generated = n + 1
        i = n % len(self.vocabulary)
        text = req.assembler.feed(self.pieces[i])
        return Outcome(self.vocabulary[i], text, None, "stop" if req.assembler.stopped else None)


def vocabulary_tokens(model: Model) -> list[int]:
    """:data:`VOCABULARY_TEXT` as ``model``'s tokens, without any end-of-generation token."""
    tokens = [t for t in model.tokenize(VOCABULARY_TEXT, parse_special=False) if not model.is_eog(t)]
    if not tokens:
        raise ValueError(f"{model.path}: the synthetic vocabulary tokenizes to nothing")
    return tokens


def open_engine(model_path: str, options: EngineOptions | None = None, **kwargs: Any) -> Engine:
    """The engine ``options.kind`` names: llama.cpp's, or the synthetic load generator.

    ``kwargs`` are :class:`Engine`'s. The synthetic engine loads only the model's vocabulary.
    """
    opts = options or EngineOptions()
    if opts.kind != "synthetic":
        return Engine(model_path, opts, **kwargs)
    model = Model(model_path, vocab_only=True)
    vocabulary = vocabulary_tokens(model)
    return Engine(
        model_path,
        opts,
        model=model,
        runner=SyntheticRunner,
        output=lambda m, _runner: SyntheticOutput(m, vocabulary),
        **kwargs,
    )
