"""The engine: many hot sessions over one llama.cpp context, driven by one scheduler thread.

Glossary (after llama.cpp's server and vLLM):
- *session*: a conversation's cache, keyed by id, owned by a principal (``session.py``).
- *sequence*: one of the context's ``hot_sessions`` KV sequences; a hot session holds one.
- *request*: one Generate or Warmup of a session, with an explicit state (``requests.py``).
- *step*: ``Scheduler.schedule()`` decides who runs with how many tokens and makes room
  (``scheduler.py``, ``kv.py``); this module fills the batch, runs one ``llama_decode`` and
  applies the results (sample, stream text, finish).

Rules: only the scheduler thread touches the llama context and KV memory; callers render
and tokenize on their own threads, then ``submit`` and read a :class:`RequestStream`.
Commands that touch KV memory (clear, close) are queued to the scheduler too. After each
step the thread publishes an immutable :class:`EngineStats`, so readers never see its
structures mid-change.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import llama_cpp as ll
import numpy as np

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate, builtin_template
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.cpus import cpu_budget
from hotloop_serve.engine.grammar import GrammarProbe
from hotloop_serve.engine.kv import RESTORE_MARGIN, KVManager, LlamaKVMemory, common_prefix
from hotloop_serve.engine.kv_state import check_state
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.persist import BlobKeys, DiskStore, SessionBlob, model_fingerprint, to_kv_bytes
from hotloop_serve.engine.prompt_tokens import PromptTokenizer
from hotloop_serve.engine.requests import Request, RequestKind, RequestState
from hotloop_serve.engine.sampling import Sampler
from hotloop_serve.engine.scheduler import PREFILL_TILE, BatchPlan, Scheduler
from hotloop_serve.engine.session import KVBytes, Session, SessionPhase, SessionRegistry
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import Chunk, RequestStream, Timings
from hotloop_serve.engine.tools import ToolSpec
from hotloop_serve.errors import (
    Cancelled,
    FailedPrecondition,
    HotloopError,
    InternalError,
    InvalidArgument,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["Engine", "EngineStats", "SessionInfo", "common_prefix"]

_GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type values
FOLLOWUP_WAIT_STEP_SHARE = 0.25
"""At most this share of a measured decoding step is spent waiting for a quick client's next
turn: it saves that client a whole step and delays the others' next token by a quarter."""


@dataclass(frozen=True)
class SessionInfo:
    id: str
    owner: str
    settings: SamplingSettings
    context_tokens: int
    state: str
    last_used: float = 0.0
    """Wall-clock time (Unix seconds) of the session's last request."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics, health and leak checks (published by the scheduler thread)."""

    sessions: int = 0
    hot_sessions: int = 0
    evicted_sessions: int = 0
    evicted_bytes: int = 0
    active_requests: int = 0
    waiting_requests: int = 0
    free_sequences: int = 0
    kv_tokens: int = 0
    steps: int = 0
    preempted_requests: int = 0
    evictions: int = 0
    preemptions: int = 0
    restores: int = 0
    drops: int = 0
    window_resets: int = 0
    forks: int = 0
    disk_files: int = 0
    disk_bytes: int = 0
    disk_restores: int = 0
    turns: int = 0
    """Generate turns finished (each counts its prompt below once, at its final chunk)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the hot KV cache (``cached_tokens / prompt_tokens``: the hit rate)."""
    restored_tokens: int = 0
    """Prompt tokens restored from the RAM or disk tier instead of re-prefilled."""


class Engine:
    """One model, one context, many sessions. Thread-safe; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        options: EngineOptions | None = None,
        *,
        default_settings: SamplingSettings | None = None,
        chat_template: str | None = None,
        sessions_per_owner: int | None = None,
        max_sample_len: int | None = None,
        blob_keys: BlobKeys | None = None,
        prestart_grammar_probe: bool = False,
    ) -> None:
        self.options = opts = options or EngineOptions()
        self.blob_keys = blob_keys or BlobKeys.ephemeral()
        """Sign exported and persisted caches and verify imported ones (``persist.py``): by
        default a key of this engine alone, so it loads no blob it did not make."""
        self.defaults = default_settings or SamplingSettings()
        self.sessions_per_owner = sessions_per_owner
        self.max_sample_len = max_sample_len
        self.model = Model(model_path, gpu_layers=opts.gpu_layers, repack=not opts.batch_invariant)
        meta = self.model.metadata
        per_seq = opts.context_tokens // opts.hot_sessions if opts.kv_layout == "per_session" else opts.context_tokens
        self.session_context = min(opts.session_context_tokens, meta.train_context_length or per_seq, per_seq)
        if chat_template is not None:
            source, origin = chat_template, "config"
        elif meta.chat_template:
            source, origin = meta.chat_template, "gguf"
        else:
            name, source = builtin_template(meta.architecture)
            origin = f"builtin:{name}"
        self.template = ChatTemplate(
            source, origin, self.model.token_text(self.model.bos), self.model.token_text(self.model.eos)
        )
        self._bos_text = self.model.token_text(self.model.bos)
        self._prompts = PromptTokenizer(
            self.model, capacity=max(64, 2 * opts.hot_sessions), max_tokens=self.session_context
        )
        self.grammars = GrammarProbe(model_path)
        """Trial builds of callers' grammars, in a child process (see ``grammar.py``), started
        with the engine when ``prestart_grammar_probe`` (a serving replica: ~140 MB for Gemma's
        vocabulary, and no first grammar waits ~1 s for it), else on the first grammar."""
        if prestart_grammar_probe:
            self.grammars.start()
        self.validate(self.defaults)

        self.fingerprint = model_fingerprint(model_path)
        """Identifies the model in exported and persisted caches (they mean nothing to another model)."""
        self.disk = (
            DiskStore(opts.persist_dir, opts.persist_bytes, self.fingerprint, self.blob_keys)
            if opts.persist_dir
            else None
        )
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "hotloop-persist") if self.disk else None
        self._ctx = self._create_context(opts)
        self._batch = ll.llama_batch_init(opts.batch_tokens, 0, 1)
        memory = self._memory = LlamaKVMemory(self._ctx, self.model.ptr, probe_token=self.model.bos)
        self.kv = KVManager(
            memory,
            sequences=opts.hot_sessions,
            capacity_tokens=opts.context_tokens,
            evicted_bytes=opts.evicted_bytes,
            shared_prefix_min_tokens=opts.shared_prefix_min_tokens,
            pooled=opts.kv_layout == "unified",
            spill=self._spill if self.disk else None,
            restore_margin=RESTORE_MARGIN if opts.swa_full else 0,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_running=opts.hot_sessions,
            batch_tokens=opts.batch_tokens,
            prefill_chunk=opts.prefill_chunk,
            end=self._end_request,
            step_target_ms=opts.step_target_ms,
            fair_prefill=opts.prefill_policy == "fair",
        )

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._sessions = SessionRegistry(opts.max_sessions, sessions_per_owner)
        self._inbox: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._order = itertools.count()
        self._rng = random.Random(opts.seed or None)
        self._steps = 0
        self._stopping = False
        self._failure: BaseException | None = None
        self._last_housekeeping = time.monotonic()
        self._expected: dict[Session, float] = {}
        """Sessions whose reply just ended and whose client comes back quickly: until when the
        next step waits for their next turn (see ``EngineOptions.followup_wait_ms``)."""
        self._stats = EngineStats(free_sequences=opts.hot_sessions)
        self._usage = {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0, "restored_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="hotloop-scheduler", daemon=True)
        self._thread.start()

    def _create_context(self, opts: EngineOptions) -> ll.llama_context_p:
        params = ll.llama_context_default_params()
        params.n_ctx = opts.context_tokens
        params.n_batch = params.n_ubatch = opts.batch_tokens
        params.n_seq_max = opts.hot_sessions
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
        if opts.batch_invariant or opts.kv_type_v != "f16":
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx = ll.llama_init_from_model(self.model.ptr, params)
        if not ctx:
            raise InternalError(f"llama.cpp could not create a context of {opts.context_tokens} tokens")
        return ctx

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._failure is None

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        session: str | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """History (and the tools offered) -> prompt tokens (on the caller's thread). With
        ``session``, only the text past that session's previous prompt is tokenized
        (``PromptTokenizer``: same tokens, a turn's worth of work instead of the whole history's)."""
        text = self.template.render(messages, add_generation_prompt, tools)
        tokens = self._prompts.tokenize(text, session)
        if self.model.add_bos and self._bos_text and not text.startswith(self._bos_text):
            tokens.insert(0, self.model.bos)
        return tokens

    def validate(self, settings: SamplingSettings) -> None:
        """Every field within this engine's bounds (InvalidArgument naming the bound otherwise).

        A grammar (or a schema's) is also built on trial in a child process the first time it is
        seen (``GrammarProbe``): this blocks the calling thread for up to a few seconds, so call
        it off the event loop.
        """
        settings.validate(self.max_sample_len, self.session_context, self.model.n_vocab)
        grammar = settings.effective_grammar
        if grammar:
            self.grammars.check(grammar, "grammar" if settings.grammar else "json_schema")

    def create_session(self, session_id: str, owner: str, settings: SamplingSettings | None = None) -> SessionInfo:
        """Register a session (idempotent for its owner); settings default to the server's."""
        settings = settings or self.defaults
        self.validate(settings)
        with self._lock:
            s, _ = self._sessions.get_or_create(session_id, owner, settings)
            s.settings = settings
            return self._info(s)

    def session_info(self, session_id: str, owner: str) -> SessionInfo:
        with self._lock:
            return self._info(self._sessions.owned(session_id, owner))

    def settings_of(self, session_id: str, owner: str) -> SamplingSettings:
        """A session's settings, or the server's defaults for a session this replica does not hold."""
        with self._lock:
            s = self._sessions.get(session_id)
            return s.settings if s is not None and s.owner == owner else self.defaults

    def known(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.get(session_id) is not None

    def update_settings(self, session_id: str, owner: str, settings: SamplingSettings) -> SessionInfo:
        return self.create_session(session_id, owner, settings)

    def clear_cache(self, session_id: str, owner: str) -> SessionInfo:
        """Empty a session's cache (its settings stay); a running request of it is cancelled."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)
        self._call(lambda: self._clear(s))
        with self._lock:
            return self._info(s)

    def close_session(self, session_id: str, owner: str) -> None:
        """Forget a session; a running request of it is cancelled."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)
        self._call(lambda: self._forget(s))

    def generate(
        self,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> RequestStream:
        """Start a reply to ``messages``; read it from the returned stream.

        ``tools`` are rendered into the prompt by the chat template; constraining the reply to
        calls is the settings' grammar (``tool_grammar.py``), parsing it the caller's.
        A request still running for the same session is superseded (cancelled): a client that
        retries a turn after losing the first attempt's stream is never refused.
        """
        return self._submit(RequestKind.GENERATE, session_id, owner, messages, settings, tools)

    def warmup(
        self,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None = None,
    ) -> RequestStream:
        """Prefill ``messages`` into the session's cache without generating.

        Warmup only adds: if the cache already starts with these messages (a system prompt
        warmed up again mid-conversation), nothing is cut.
        """
        return self._submit(RequestKind.WARMUP, session_id, owner, messages, settings)

    def fork_session(
        self,
        source_id: str,
        owner: str,
        new_id: str,
        messages: Sequence[ChatMessage] | None = None,
        settings: SamplingSettings | None = None,
    ) -> SessionInfo:
        """A new session starting with ``source_id``'s cache, whole or up to ``messages`` (a prefix of
        its history): copied in KV memory, not prefilled again. Settings default to the source's."""
        with self._lock:
            self._check_alive()
            src = self._sessions.owned(source_id, owner)
            if self._sessions.get(new_id) is not None:
                raise FailedPrecondition(f"session {new_id} already exists; fork into a new session id")
            settings = settings or src.settings
        self.validate(settings)
        keep: list[int] | None = self.render(messages, add_generation_prompt=False) if messages else None
        with self._lock:
            dst, _ = self._sessions.get_or_create(new_id, owner, settings)

        def fork() -> None:
            n = len(src.tokens) if keep is None else common_prefix(src.tokens, keep)
            self.kv.fork(src, dst, n, [r.session for r in self.scheduler.running])

        self._call(fork)
        return self.session_info(new_id, owner)

    def list_sessions(self, owner: str | None) -> list[SessionInfo]:
        """The sessions of ``owner`` (None: of everyone) on this engine, most recently used first."""
        with self._lock:
            mine = [self._info(s) for s in self._sessions.values() if owner is None or s.owner == owner]
        return sorted(mine, key=lambda i: i.last_used, reverse=True)

    def release_session(self, session_id: str, owner: str) -> bytes | None:
        """Hand a session over: its exported cache, and it is forgotten here (its persisted copy
        too). None, keeping it, when it is serving a request or holds no cache."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)

        def release() -> tuple[list[int], KVBytes | None]:
            if s.busy:
                return [], None
            tokens, data = self.kv.snapshot(s, leaving=True)
            if data is not None:
                data = to_kv_bytes(bytes(data))  # a copy: forgetting frees the original
                self._forget(s)
            return tokens, data

        tokens, data = self._call(release)
        if data is None:
            return None
        return SessionBlob(self.fingerprint, tokens, s.settings, bytes(data)).encode(self.blob_keys)

    def export_session(self, session_id: str, owner: str) -> bytes:
        """The session's cache as a portable blob (tokens, KV state, settings, model fingerprint)."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)
        tokens, data = self._call(lambda: self.kv.snapshot(s, leaving=True))
        kv = bytes(data) if data is not None else b""
        return SessionBlob(self.fingerprint, tokens if kv else [], s.settings, kv).encode(self.blob_keys)

    def adopt_session(self, session_id: str, owner: str, data: bytes) -> bool:
        """Take a handed-over session, over a copy here that is idle and holds fewer tokens (a
        stale copy from a turn that spilled here, or settings without a cache); False, keeping
        what is here, when that copy is busy or at least as long."""
        tokens = len(SessionBlob.decode(data, self.fingerprint, self.blob_keys).tokens)
        with self._lock:
            s = self._sessions.get(session_id)
        if s is not None:
            with self._lock:
                s = self._sessions.owned(session_id, owner)

            def drop_if_stale() -> bool:
                if s.busy or s.context_tokens >= tokens:
                    return False
                self._forget(s)
                return True

            if not self._call(drop_if_stale):
                return False
        self.import_session(session_id, owner, data)
        return True

    def import_session(
        self,
        session_id: str,
        owner: str,
        data: bytes,
        settings: SamplingSettings | None = None,
        keep: Sequence[ChatMessage] | None = None,
    ) -> SessionInfo:
        """Create ``session_id`` from an exported blob, hot; ``keep``: only the cache of this prefix
        of its history (a fork). Damaged data is INVALID_ARGUMENT and a blob of another model
        FAILED_PRECONDITION; either way nothing of it stays behind."""
        blob = SessionBlob.decode(data, self.fingerprint, self.blob_keys)
        if any(not 0 <= t < self.model.n_vocab for t in blob.tokens):
            raise InvalidArgument("session export holds tokens outside this model's vocabulary")
        if len(blob.tokens) > self.session_context:
            raise OutOfRange(
                f"session export holds {len(blob.tokens)} tokens, over the window of {self.session_context}"
            )
        if blob.kv:
            self.check_state(blob.kv, len(blob.tokens))
        settings = settings or blob.settings
        self.validate(settings)
        keep_tokens = self.render(keep, add_generation_prompt=False) if keep else None
        with self._lock:
            self._check_alive()
            if self._sessions.get(session_id) is not None:
                raise FailedPrecondition(f"session {session_id} already exists; import into a new session id")
            s, _ = self._sessions.get_or_create(session_id, owner, settings)

        def place() -> bool:
            if not blob.kv:
                return True
            self.kv.adopt(s, blob.tokens, to_kv_bytes(blob.kv))
            protect = [r.session for r in self.scheduler.running]
            ok = self.kv.acquire(s, protect) and self.kv.restore(s, protect) == len(blob.tokens) > 0
            if ok and keep_tokens is not None:
                self.kv.cut(s, common_prefix(s.tokens, keep_tokens))
            return ok

        if not self._call(place):
            self._call(lambda: self._forget(s))
            raise InvalidArgument("session export could not be loaded into the KV cache (its state is invalid)")
        return self.session_info(session_id, owner)

    def check_state(self, kv: bytes, n_tokens: int) -> None:
        """InvalidArgument unless ``kv`` is this model's state of exactly ``n_tokens`` tokens
        (``kv_state.check_state``), checked before llama.cpp reads a byte of it: a state whose
        cells do not continue its tokens would fail every session's decode in the next batch."""
        self._memory.calibrated.wait(timeout=60.0)
        layout = self._memory.layout
        if layout is not None:
            check_state(kv, n_tokens, layout)

    def stats(self) -> EngineStats:
        snap = self._stats
        files, size = self.disk.usage() if self.disk is not None else (0, 0)
        return replace(
            snap,
            sessions=len(self._sessions),
            active_requests=snap.active_requests + len(self._inbox),
            disk_files=files,
            disk_bytes=size,
            **self._usage,
        )

    def close(self) -> None:
        """Stop the scheduler (failing what is in flight) and free llama.cpp's memory.

        With a disk tier, every cached session is written to it first, so a restarted server
        resumes them from disk.
        """
        if self.disk is not None and self.alive:
            try:
                self._call(self._snapshot_all)
            except HotloopError as e:
                log.warning("could not snapshot sessions at shutdown: %s", e.message)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._wakeup.notify_all()
        self._thread.join(timeout=30)
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        self.grammars.close()
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ submission helpers
    def _check_alive(self) -> None:
        """Fail fast once the engine stopped or failed (under the lock)."""
        if self._failure is not None:
            raise Unavailable(f"this replica's engine failed ({self._failure}); retry on another replica")
        if self._stopping or not self._thread.is_alive():
            raise Unavailable("the engine is shutting down; retry the request")

    def _submit(
        self,
        kind: RequestKind,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None,
        tools: Sequence[ToolSpec] = (),
    ) -> RequestStream:
        if not messages:
            raise InvalidArgument("history is empty: send at least one message")
        with self._lock:
            self._check_alive()
            existing = self._sessions.get(session_id)
            base = existing.settings if existing is not None and existing.owner == owner else self.defaults
        settings = settings or base
        self.validate(settings)
        prompt = self.render(
            messages, add_generation_prompt=kind is RequestKind.GENERATE, session=session_id, tools=tools
        )
        prompt = self._fit(prompt, messages, settings, kind, tools)
        # Built here, not under the lock: a grammar sampler's build is llama.cpp parsing the
        # grammar, and the scheduler thread must never wait on it.
        generate = kind is RequestKind.GENERATE
        sampler = Sampler(settings, self.model.n_vocab, self._rng, self.model.vocab) if generate else None
        try:
            with self._lock:
                self._check_alive()
                session, _ = self._sessions.get_or_create(session_id, owner, settings)
                if session.finished_at:
                    session.return_s = time.perf_counter() - session.finished_at
                    session.finished_at = 0.0
                queued = len(self._inbox) + len(self.scheduler.waiting)
                if queued >= self.options.max_queue:
                    raise ResourceExhausted(
                        f"replica queue is full (engine.max_queue={self.options.max_queue} waiting requests); "
                        "retry later"
                    )
                running = session.request
                if running is not None and running.live and running.state is not RequestState.CACHING_TAIL:
                    running.cancel_requested = True  # superseded by this newer turn
                for other in self._inbox:
                    if other.session is session:
                        other.cancel_requested = True
                req = Request(kind, session, prompt, settings, self._wake, order=next(self._order))
                if self.disk is not None and session.phase in (SessionPhase.NEW, SessionPhase.DROPPED):
                    self._inbox_disk_load(req)
                req.sampler = sampler
                session.pending += 1
                session.last_used = time.monotonic()
                self._inbox.append(req)
                self._wakeup.notify()
        except BaseException:
            if sampler is not None:
                sampler.free()
            raise
        return req.stream

    def _fit(
        self,
        prompt: list[int],
        messages: Sequence[ChatMessage],
        settings: SamplingSettings,
        kind: RequestKind,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """Check the prompt fits the session's window; drop the oldest turns if the settings allow it.

        Truncation binary-searches how many turns to drop: O(log n) renders of the history,
        not one per dropped turn.
        """
        generate = kind is RequestKind.GENERATE
        limit = self.session_context - (1 if generate else 0)
        if len(prompt) <= limit:
            return prompt
        if not settings.truncate_history:
            raise OutOfRange(
                f"history is {len(prompt)} tokens but a session holds at most {self.session_context} "
                f"(prompt + reply); shorten the history or set truncate_history"
            )
        msgs = list(messages)
        keep_system = 1 if msgs and msgs[0].role == "system" else 0
        headroom = min(settings.sample_len, self.session_context // 4)

        def render_dropping(k: int) -> list[int]:
            kept = [*msgs[:keep_system], *msgs[keep_system + k :]]
            return self.render(kept, add_generation_prompt=generate, tools=tools)

        lo, hi = 1, len(msgs) - keep_system - 1  # drop at least one turn, keep the last message
        best: list[int] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = render_dropping(mid)
            if len(candidate) + headroom <= self.session_context:
                best, hi = candidate, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return best
        last = render_dropping(max(len(msgs) - keep_system - 1, 0))
        if len(last) <= limit:
            return last
        raise OutOfRange(
            f"the last message alone renders to {len(last)} tokens, over the session window of "
            f"{self.session_context}; shorten it"
        )

    @staticmethod
    def _info(s: Session) -> SessionInfo:
        last_used = time.time() - (time.monotonic() - s.last_used)
        return SessionInfo(s.id, s.owner, s.settings, s.context_tokens, s.phase.value, last_used)

    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify()

    def _inbox_disk_load(self, req: Request) -> None:
        """Attach a persisted cache to a request of a session RAM does not hold (lock held; the
        file is small next to a prefill, and read here, off the scheduler thread)."""
        assert self.disk is not None
        blob = self.disk.get(req.session.id, req.session.owner)
        if blob is None or not blob.kv:
            return
        try:
            self.check_state(blob.kv, len(blob.tokens))
        except InvalidArgument as e:
            log.warning("discarding persisted session %s: %s", req.session.id, e.message)
            self.disk.delete(req.session.id)
            return
        req.disk = (blob.tokens, to_kv_bytes(blob.kv))

    def _spill(self, s: Session, tokens: list[int], data: KVBytes) -> None:
        """Host RAM dropped an idle session: keep it on disk (written by a background thread)."""
        assert self.disk is not None and self._writer is not None
        blob = SessionBlob(self.fingerprint, tokens, s.settings, bytes(data), owner=s.owner)
        s.disk = True
        self._writer.submit(self.disk.put, s.id, blob)

    def _snapshot_all(self) -> None:
        for s in self._sessions.values():
            tokens, data = self.kv.snapshot(s, leaving=True)
            if data is not None and tokens:
                self._spill(s, tokens, data)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread (it owns KV memory) and wait for it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._check_alive()
            self._commands.append((fn, fut))
            self._wakeup.notify()
        return fut.result()

    # ------------------------------------------------------------------ scheduler thread
    def _has_work(self) -> bool:
        return bool(self._inbox or self._commands or self.scheduler.running or self.scheduler.waiting)

    def _run(self) -> None:
        try:
            # Every llama_decode runs on this thread, the calibration's too (see LlamaKVMemory.calibrate).
            self._memory.calibrate()
            while True:
                if self._expected:
                    self._await_followups()
                with self._lock:
                    while not (self._stopping or self._has_work()):
                        self._wakeup.wait(timeout=1.0)
                        self._housekeeping()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                    for req in self._inbox:
                        self.scheduler.add(req)
                    self._inbox.clear()
                    self._housekeeping()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:
                        fut.set_exception(e)
                plan = self.scheduler.schedule()
                if plan.new_tokens:
                    self._step(plan)
                self._publish()
                if not plan.new_tokens and self.scheduler.waiting:
                    # Nothing runnable (waiting on busy sessions): sleep until something changes.
                    with self._lock:
                        if not (self._inbox or self._commands or self._stopping):
                            self._wakeup.wait(timeout=0.05)
        except BaseException as e:  # a llama.cpp failure: fail everything, refuse new work
            log.exception("engine scheduler failed")
            self._failure = e
        finally:
            error: HotloopError = Unavailable("the engine stopped; retry the request")
            if self._failure is not None:
                error = Unavailable(f"this replica's engine failed ({self._failure}); retry on another replica")
            with self._lock:
                pending = [*self.scheduler.requests, *self._inbox]
                self.scheduler.running.clear()
                self.scheduler.waiting.clear()
                self._inbox.clear()
                commands = list(self._commands)
                self._commands.clear()
            for req in pending:
                if req.live:
                    self._end_request(req, RequestState.FAILED, error)
            for _, fut in commands:
                fut.set_exception(error)
            self._publish()

    def _await_followups(self) -> None:
        """Hold the next step briefly for the next turns of quick clients whose replies just ended.

        Their next request typically lands a few milliseconds after the reply's final chunk,
        just after the next step started: it would wait that whole step, then take another.
        Waiting only when other requests share the engine (alone, a step is short anyway), only
        for clients that came back this fast last time, and at most a fraction of a step keeps
        the cost to the others small (bench/replay.py measures both sides).
        """
        expected = self._expected
        if all(r.session in expected for r in self.scheduler.running):
            expected.clear()
            return
        with self._lock:
            while expected and not (self._stopping or self._commands):
                now = time.perf_counter()
                for s in [s for s, until in expected.items() if s.pending or s.closed or until <= now]:
                    del expected[s]
                if expected:
                    self._wakeup.wait(timeout=min(expected.values()) - now)
            expected.clear()

    def _followup_wait_s(self) -> float:
        cap = self.options.followup_wait_ms / 1e3
        step = self.scheduler.pacer.decode_s
        return cap if step is None else min(cap, FOLLOWUP_WAIT_STEP_SHARE * step)

    def _publish(self) -> None:
        """Publish an immutable snapshot of the scheduler's state (readers never lock)."""
        kv, sched = self.kv, self.scheduler
        c = kv.counters
        self._stats = EngineStats(
            sessions=len(self._sessions),
            hot_sessions=len(kv.hot),
            evicted_sessions=len(kv.evicted),
            evicted_bytes=kv.evicted.bytes,
            active_requests=len(sched.running) + len(sched.waiting),
            waiting_requests=len(sched.waiting),
            free_sequences=kv.free_sequences,
            kv_tokens=kv.used(),
            steps=self._steps,
            preempted_requests=sum(1 for r in sched.waiting if r.state is RequestState.PREEMPTED),
            evictions=c["evictions"],
            preemptions=c["preemptions"],
            restores=c["restores"],
            drops=c["drops"],
            window_resets=c["window_resets"],
            forks=c["forks"],
            disk_restores=c["disk_restores"],
        )

    def _housekeeping(self) -> None:
        """Forget sessions idle past their TTL, at most once a second, under load too (lock held)."""
        now = time.monotonic()
        if now - self._last_housekeeping < 1.0:
            return
        self._last_housekeeping = now
        for s in self._sessions.idle_past(self.options.idle_ttl_s, now):
            self._commands.append((lambda s=s: self._expire(s), concurrent.futures.Future()))  # type: ignore[misc]

    def _expire(self, s: Session) -> None:
        if not s.busy and time.monotonic() - s.last_used > self.options.idle_ttl_s:
            self._forget(s, keep_on_disk=True)  # the TTL frees memory; a persisted copy may still serve

    def _end_request(self, req: Request, state: RequestState, error: HotloopError | None) -> None:
        """The one way a request ends: its state, its resources, its stream's last item."""
        if req.state is RequestState.WAITING:
            req.session.pending -= 1
        req.transition(state)
        if error is not None:
            req.stream.put(error)
        elif state is RequestState.FINISHED:
            self._send_final(req, "eos")
            if req.kind is RequestKind.GENERATE:
                u = self._usage  # written by the scheduler thread only; stats() copies it
                u["turns"] += 1
                u["prompt_tokens"] += req.usage.prompt_tokens
                u["cached_tokens"] += req.usage.cached_tokens
                u["restored_tokens"] += req.usage.restored_tokens

    def _end_session_request(self, s: Session, why: str) -> None:
        """End whatever request holds ``s`` (clear or close); a finished reply's tail is not cached."""
        req = s.request
        if req is None or not req.live:
            return
        if req.state is RequestState.CACHING_TAIL:
            self._end_request(req, RequestState.FINISHED, None)
        else:
            if req.state is RequestState.PREEMPTED:
                self.kv.discard_saved(s)
            self._end_request(req, RequestState.CANCELLED, Cancelled(f"request cancelled: the session was {why}"))
        self.scheduler.drop_finished()
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)

    def _clear(self, s: Session) -> None:
        self._end_session_request(s, "cleared")
        if not s.closed:
            self.kv.clear(s)
        self._delete_persisted(s)

    def _delete_persisted(self, s: Session) -> None:
        if self.disk is not None and self._writer is not None:
            self._writer.submit(self.disk.delete, s.id)  # queued after any write of it: ordered
            s.disk = False

    def _forget(self, s: Session, keep_on_disk: bool = False) -> None:
        self._end_session_request(s, "closed")
        self._prompts.forget(s.id)
        if keep_on_disk and self.disk is not None:
            tokens, data = self.kv.snapshot(s, leaving=True)
            if data is not None and tokens:
                self._spill(s, tokens, data)
        elif not keep_on_disk:
            self._delete_persisted(s)
        self.kv.forget(s)
        with self._lock:
            self._sessions.remove(s)

    # ------------------------------------------------------------------ one step: execute, update
    def _step(self, plan: BatchPlan) -> None:
        """Run the plan: one ``llama_decode``, or two with ``batch_invariant``.

        With ``batch_invariant`` the rows that make logits (decoders, and the last prompt token of
        each reply) run in a batch of their own, after the step's other prompt rows: llama.cpp's
        CPU kernels round differently once a batch holds 8 rows or more (and again from 64,
        flash attention's tiled path), so a decoder beside a prompt, or a reply's last prompt
        token inside its prompt, would get other logits than alone and a greedy reply could
        change with the load. The split costs a few ms per step that prefills beside decoders
        (bench/README.md, "Reproducibility"); it keeps a follow-up's first token in the step
        that prefills its prompt.
        """
        running = list(self.scheduler.running)
        decoded = [running[i] for i in plan.decode]
        chunks = [(running[i], count) for i, count in plan.prefill]
        elapsed = 0.0
        if self.options.batch_invariant:
            body: list[tuple[Request, int]] = []
            last_tokens: list[tuple[Request, int]] = []
            for req, count in chunks:
                ends = self._completes(req, count)
                if ends:
                    last_tokens.append((req, 1))
                if count > ends:
                    body.append((req, count - ends))
            if body and (decoded or last_tokens):
                took = self._run_batch([], body)
                if took is None:
                    return
                elapsed = took
                chunks = last_tokens
        took = self._run_batch(decoded, chunks)
        if took is None:
            return
        self._steps += 1
        self.scheduler.pacer.observe(len(decoded), sum(count for _, count in plan.prefill), elapsed + took)
        self.scheduler.drop_finished()

    @staticmethod
    def _completes(req: Request, count: int) -> bool:
        """Whether prefilling ``count`` more tokens ends a prompt whose last token makes logits."""
        return req.needs_logits and len(req.session.tokens) + count == len(req.prompt)

    def _run_batch(self, decoded: list[Request], chunks: list[tuple[Request, int]]) -> float | None:
        """One ``llama_decode`` of ``decoded``'s next tokens and ``chunks`` of prompts; apply the
        results and sample. The seconds llama.cpp took, or None when it refused the batch."""
        batch = self._batch
        n = 0
        outputs: list[tuple[Request, int]] = []
        for req in decoded:
            seq = req.session.seq
            assert seq is not None and req.last_token is not None
            batch.token[n] = req.last_token
            batch.pos[n] = len(req.session.tokens)
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            wants = req.state is RequestState.DECODING
            batch.logits[n] = wants
            if wants:
                outputs.append((req, n))
            n += 1
        # Whole-tile prompt pieces first, so each starts on a flash-attention query tile
        # (scheduler.PREFILL_TILE) where no decoder rows come before them (batch_invariant).
        chunks = sorted(chunks, key=lambda chunk: chunk[1] % PREFILL_TILE != 0)
        for req, count in chunks:
            seq = req.session.seq
            assert seq is not None
            start = len(req.session.tokens)
            for k in range(count):
                batch.token[n] = req.prompt[start + k]
                batch.pos[n] = start + k
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = False
                n += 1
            if self._completes(req, count):
                batch.logits[n - 1] = True
                outputs.append((req, n - 1))
        batch.n_tokens = n
        t0 = time.perf_counter()
        rc = ll.llama_decode(self._ctx, batch)
        took = time.perf_counter() - t0
        if rc != 0:
            self._decode_failed(rc)
            return None
        # Update: the batch's tokens are now in the cache.
        for req in decoded:
            assert req.last_token is not None
            req.session.tokens.append(req.last_token)
            if req.state is RequestState.CACHING_TAIL:
                self._end_request(req, RequestState.FINISHED, None)
        for req, count in chunks:
            start = len(req.session.tokens)
            req.session.tokens.extend(req.prompt[start : start + count])
            if req.prefill_remaining == 0:
                if req.kind is RequestKind.WARMUP:
                    self._end_request(req, RequestState.FINISHED, None)
                elif req.resume_token is not None:  # a pre-empted reply rebuilt its cache: go on decoding
                    req.last_token, req.resume_token = req.resume_token, None
                    req.transition(RequestState.DECODING)
        if outputs:
            # One view of every row of logits: a llama_get_logits_ith call per row would release
            # the GIL each time, handing it to the replica's event loop in the middle of the step.
            rows = np.ctypeslib.as_array(ll.llama_get_logits(self._ctx), shape=(len(outputs), self.model.n_vocab))
            for row, (req, index) in enumerate(outputs):
                if req.live:
                    self._sample(req, index, rows[row])
        return took

    def _decode_failed(self, rc: int) -> None:
        """llama_decode refused the batch: 1 = no room in the KV cache; anything else is fatal."""
        if rc != 1:
            raise RuntimeError(f"llama_decode failed with {rc}")
        if len(self.scheduler.running) > 1 and self.scheduler.preempt_newest():
            return  # retried next step with fewer sequences
        for req in list(self.scheduler.running):
            self._end_request(
                req,
                RequestState.FAILED,
                ResourceExhausted(
                    f"the replica's KV cache is full (engine.context_tokens={self.options.context_tokens}); "
                    "retry, or raise context_tokens"
                ),
            )
            self.kv.clear(req.session)
        self.scheduler.drop_finished()

    def _sample(self, req: Request, index: int, logits: np.ndarray) -> None:
        assert req.sampler is not None
        now = time.perf_counter()
        if req.generated == 0:
            req.t_first = now
        token = req.sampler.sample(self._ctx, index, logits)
        if self.model.is_eog(token):
            self._finish(req, "eos", cache_token=token)
            return
        req.generated += 1
        if req.settings.logprobs:
            req.sampler.record_logprob(self._ctx, index, token, self.model.piece)
        text = req.assembler.feed(self.model.piece(token))
        if req.assembler.stopped:
            if text:
                req.stream.put(Chunk(text, logprobs=req.sampler.take_logprobs()))
            self._finish(req, "stop")
            return
        if text:
            req.stream.put(Chunk(text, logprobs=req.sampler.take_logprobs()))
        if req.generated >= req.settings.sample_len:
            self._finish(req, "length", cache_token=token)
        elif len(req.session.tokens) + 1 >= self.session_context:
            self._finish(req, "context")
        else:
            req.last_token = token
            if req.state is RequestState.PREFILLING:
                req.transition(RequestState.DECODING)

    def _send_final(self, req: Request, reason: str) -> None:
        text = "" if req.assembler.stopped else req.assembler.flush()
        end = time.perf_counter()
        req.usage.completion_tokens = req.generated
        t0 = req.t_admit or req.t_submit
        first = req.t_first or end
        timings = Timings(
            queue_ms=(t0 - req.t_submit) * 1e3,
            prefill_ms=(first - t0) * 1e3,
            time_to_first_token_ms=(first - req.t_submit) * 1e3,
            decode_ms=(end - first) * 1e3 if req.t_first else 0.0,
        )
        hit = req.usage.cached_tokens + req.usage.restored_tokens > 0
        logprobs = req.sampler.take_logprobs() if req.sampler is not None else None
        req.stream.put(Chunk(text, reason, req.usage, timings, cache_hit=hit, logprobs=logprobs))

    def _finish(self, req: Request, reason: str, cache_token: int | None = None) -> None:
        """Send the final chunk now; keep the request one more step to cache its last token if it fits."""
        s = req.session
        if not req.cancel_requested:  # before the chunk: the client's next request may follow at once
            s.finished_at = time.perf_counter()
            wait = self._followup_wait_s()
            if wait > 0 and (s.return_s is None or s.return_s <= wait):
                self._expected[s] = s.finished_at + wait
        self._send_final(req, reason)
        fits = len(req.session.tokens) + 1 < self.session_context
        if cache_token is not None and fits and not req.cancel_requested:
            req.last_token = cache_token
            req.transition(RequestState.CACHING_TAIL)
        else:
            self._end_request(req, RequestState.FINISHED, None)
