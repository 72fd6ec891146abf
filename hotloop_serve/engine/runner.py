"""The model runner: the llama.cpp context and its batch, and nothing about requests.

It executes one step's plan, given as pieces (``scheduler.Piece``: a run of tokens for one
sequence at known positions), with one ``llama_decode`` (two with ``batch_invariant``, a
canonical series with ``deterministic``: ``canonical.py``), and
returns how long llama.cpp took and the logits rows asked for. It never decides who runs (the
scheduler does) and never samples (the output stage does), so what it guarantees is narrow:
each row comes back with the piece that asked for it, and ``cached`` says which tokens entered
the cache, also when llama.cpp refused part of the step.

Only the engine's scheduler thread calls it (llama.cpp contexts are not thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import llama_cpp as ll
import numpy as np

from hotloop_serve.engine.canonical import Rows, canonical_decodes
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.cpus import cpu_budget
from hotloop_serve.engine.kv import KVMemory, LlamaKVMemory
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.scheduler import PREFILL_TILE, Piece
from hotloop_serve.errors import InternalError

log = logging.getLogger(__name__)

_GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type values
_NO_ROOM = 1
"""``llama_decode``'s return code for "no room in the KV cache": recoverable (pre-empt, retry)."""
_INVALID_BATCH = -1
"""``llama_decode``'s return code for a batch it refused to start, e.g. a sequence whose cached
positions do not continue at the batch's: nothing was computed; recoverable if the culprits are
found (:attr:`StepOutput.inconsistent`)."""


@dataclass(frozen=True, slots=True)
class Logits:
    """One row of logits and its index in the step's last batch (llama.cpp's samplers take the index)."""

    index: int
    row: np.ndarray


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step did: seconds llama.cpp took, the logits per piece, the tokens now cached."""

    seconds: float
    logits: tuple[Logits | None, ...]
    """Per piece, in the plan's order: its row, or None (no logits asked, or the step was refused)."""
    cached: tuple[int, ...]
    """Per piece, how many of its tokens are now in the cache: all of them, unless ``refused``."""
    refused: bool = False
    """llama.cpp found no room in the KV cache for (part of) the step."""
    inconsistent: tuple[int, ...] = ()
    """Pieces whose sequence's cache does not end where the piece starts: llama.cpp refused the
    batch for them. The others are retried next step; these sessions' caches must be dropped."""


class InconsistentPieces(Exception):
    """``llama_decode`` refused a batch because these pieces' sequences do not continue there."""

    def __init__(self, pieces: tuple[int, ...]) -> None:
        super().__init__(f"pieces {pieces} do not continue their sequences")
        self.pieces = pieces
        self.cached: tuple[int, ...] = ()


class RunnerMemory(KVMemory, Protocol):
    """A runner's KV memory: the manager's operations, and a calibration on the scheduler thread."""

    def calibrate(self) -> None: ...


class Runner(Protocol):
    """What the engine needs of a runner: :class:`ModelRunner`, or the synthetic engine's
    (``synthetic.py``), which replaces llama.cpp by a clock to load the serving layer."""

    @property
    def ctx(self) -> ll.llama_context_p | None:
        """The llama.cpp context the output stage samples from (None: it samples nothing)."""

    @property
    def memory(self) -> RunnerMemory: ...

    def execute(self, pieces: Sequence[Piece]) -> StepOutput: ...

    def close(self) -> None: ...


class ModelRunner:
    """One llama.cpp context, its batch and its KV memory. Scheduler thread only."""

    def __init__(self, model: Model, opts: EngineOptions) -> None:
        self.model = model
        self.batch_invariant = opts.batch_invariant
        self.deterministic = opts.deterministic
        self.ctx = _create_context(model, opts)
        self._batch = ll.llama_batch_init(opts.batch_tokens, 0, 1)  # >= 8: a deterministic call's 7 rows fit
        self.memory = LlamaKVMemory(self.ctx, model.ptr, probe_token=model.bos)

    def execute(self, pieces: Sequence[Piece]) -> StepOutput:
        """Run ``pieces``: one ``llama_decode``, or two with ``batch_invariant``.

        With ``batch_invariant`` the rows that make logits (decoders, and the last prompt token of
        each reply) run in a batch of their own, after the step's other prompt rows: llama.cpp's
        CPU kernels round differently once a batch holds 8 rows or more (and again from 64,
        flash attention's tiled path), so a decoder beside a prompt, or a reply's last prompt
        token inside its prompt, would get other logits than alone, and a greedy reply could
        change with the load. The split costs a second, small ``llama_decode`` in the steps that
        prefill beside decoders; it keeps a follow-up's first token in the step that prefills
        its prompt.
        """
        try:
            return self._execute(pieces)
        except InconsistentPieces as e:
            log.error("llama.cpp refused a step: the caches of %d sequence(s) do not continue", len(e.pieces))
            return StepOutput(0.0, (None,) * len(pieces), e.cached or (0,) * len(pieces), inconsistent=e.pieces)

    def _execute(self, pieces: Sequence[Piece]) -> StepOutput:
        if self.deterministic:
            return self._execute_canonical(pieces)
        if self.batch_invariant:
            body = [len(p.tokens) - (1 if p.logits else 0) if not p.decoding else 0 for p in pieces]
            last = any(p.decoding or p.logits for p in pieces)
            if any(body) and last:
                first = _laid_out(pieces, [(i, 0, n) for i, n in enumerate(body) if n])
                took = self.decode(pieces, first)
                if took is None:
                    return self._refused(pieces, [0] * len(pieces))
                tails = [(i, body[i], len(p.tokens) - body[i]) for i, p in enumerate(pieces) if len(p.tokens) > body[i]]
                second = _laid_out(pieces, tails)
                try:
                    rest = self.decode(pieces, second)
                except InconsistentPieces as e:
                    e.cached = tuple(body)  # the first decode's rows are in the cache
                    raise
                if rest is None:
                    return self._refused(pieces, body)
                return self._output(pieces, second, took + rest)
        whole = _laid_out(pieces, [(i, 0, len(p.tokens)) for i, p in enumerate(pieces)])
        took = self.decode(pieces, whole)
        if took is None:
            return self._refused(pieces, [0] * len(pieces))
        return self._output(pieces, whole, took)

    def _execute_canonical(self, pieces: Sequence[Piece]) -> StepOutput:
        """The step as :func:`canonical.canonical_decodes`: each row computed as it would be alone.

        The logits rows are copied out after each decode (the next one overwrites them), so they
        reach the samplers with index -1 (``sampling.Sampler.sample`` reads the row). A shadow
        row's cell is removed after its call. Where llama.cpp refuses one of the decodes, what
        this step added is taken out of every sequence again, so the step is retried whole (a
        decoder whose row ran but whose logits are dropped would otherwise cache its token twice)."""
        logits: list[Logits | None] = [None] * len(pieces)
        seconds = 0.0
        try:
            for d in canonical_decodes(pieces):
                took = self.decode(pieces, d.rows, d.shadows)
                if took is None:
                    self._roll_back(pieces)
                    return self._refused(pieces, [0] * len(pieces))
                for i in d.shadows:
                    self.memory.seq_rm(pieces[i].seq, pieces[i].pos + len(pieces[i].tokens), -1)
                seconds += took
                wanted = [i for i, start, n in d.rows if pieces[i].logits and start + n == len(pieces[i].tokens)]
                if wanted:
                    view = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(len(wanted), self.model.n_vocab))
                    for k, i in enumerate(wanted):
                        logits[i] = Logits(-1, view[k].copy())
        except InconsistentPieces as e:
            self._roll_back(pieces, skip=e.pieces)
            e.cached = (0,) * len(pieces)
            raise
        return StepOutput(seconds, tuple(logits), tuple(len(p.tokens) for p in pieces))

    def _roll_back(self, pieces: Sequence[Piece], skip: tuple[int, ...] = ()) -> None:
        """Take this step's cells out of its sequences again (a refused deterministic step)."""
        for i, p in enumerate(pieces):
            if i not in skip:
                self.memory.seq_rm(p.seq, p.pos, -1)

    def decode(self, pieces: Sequence[Piece], rows: Rows, shadows: Sequence[int] = ()) -> float | None:
        """One ``llama_decode`` of ``rows`` (piece, first token, count) in that order, each piece
        in ``shadows`` followed by its shadow row (its last token again, one position further,
        no logits; deterministic mode, ``canonical.py``); the seconds it took, or None when
        llama.cpp found no room. A batch refused for pieces whose cache does not continue
        raises :class:`InconsistentPieces`; any other failure is fatal (raised)."""
        batch = self._batch
        n = 0
        for i, start, count in rows:
            p = pieces[i]
            for k in range(start, start + count):
                batch.token[n] = p.tokens[k]
                batch.pos[n] = p.pos + k
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = p.seq
                batch.logits[n] = False
                n += 1
            if p.logits and start + count == len(p.tokens):
                batch.logits[n - 1] = True
            if i in shadows:
                batch.token[n] = p.tokens[start + count - 1]
                batch.pos[n] = p.pos + start + count
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = p.seq
                batch.logits[n] = False
                n += 1
        batch.n_tokens = n
        t0 = time.perf_counter()
        rc = ll.llama_decode(self.ctx, batch)
        took = time.perf_counter() - t0
        if rc == _NO_ROOM:
            return None
        if rc == _INVALID_BATCH:
            culprits = tuple(
                sorted({i for i, start, _ in rows if self.memory.pos_max(pieces[i].seq) != pieces[i].pos + start - 1})
            )
            if culprits:
                raise InconsistentPieces(culprits)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc}")
        return took

    def _output(self, pieces: Sequence[Piece], rows: Rows, seconds: float) -> StepOutput:
        logits: list[Logits | None] = [None] * len(pieces)
        wanted: list[tuple[int, int]] = []  # (piece, batch index)
        n = 0
        for i, start, count in rows:
            n += count
            if pieces[i].logits and start + count == len(pieces[i].tokens):
                wanted.append((i, n - 1))
        if wanted:
            # One view of every row of logits: a llama_get_logits_ith call per row would release
            # the GIL each time, handing it to the replica's event loop in the middle of the step.
            view = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(len(wanted), self.model.n_vocab))
            for row, (i, index) in enumerate(wanted):
                logits[i] = Logits(index, view[row])
        return StepOutput(seconds, tuple(logits), tuple(len(p.tokens) for p in pieces))

    @staticmethod
    def _refused(pieces: Sequence[Piece], cached: list[int]) -> StepOutput:
        return StepOutput(0.0, (None,) * len(pieces), tuple(cached), refused=True)

    def close(self) -> None:
        """Free the batch and the context (the engine frees the model it shares)."""
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None


def _laid_out(pieces: Sequence[Piece], rows: Rows) -> Rows:
    """The batch's order: decoders first, then whole-tile prompt pieces, so each of those starts
    on a flash-attention query tile (:data:`PREFILL_TILE`) with no decoder rows before it."""
    return sorted(rows, key=lambda r: (not pieces[r[0]].decoding, r[2] % PREFILL_TILE != 0))


def _create_context(model: Model, opts: EngineOptions) -> ll.llama_context_p:
    params = ll.llama_context_default_params()
    params.n_ctx = opts.context_tokens
    params.n_batch = params.n_ubatch = opts.batch_tokens
    params.n_seq_max = opts.sequences
    if opts.threads:
        threads = opts.threads
        log.info("llama.cpp decodes with %d threads (engine.threads)", threads)
    else:
        budget = cpu_budget()
        threads = budget.threads
        log.info("llama.cpp decodes with %s", budget.describe())
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = opts.kv_layout == "unified"
    params.swa_full = opts.swa_full
    params.type_k = _GGML_TYPES[opts.kv_type_k]
    params.type_v = _GGML_TYPES[opts.kv_type_v]
    params.no_perf = True
    if opts.flash_attention or opts.batch_invariant or opts.deterministic or opts.kv_type_v != "f16":
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
    else:
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = ll.llama_init_from_model(model.ptr, params)
    if not ctx:
        raise InternalError(f"llama.cpp could not create a context of {opts.context_tokens} tokens")
    return ctx
