"""The engine: many hot sessions over one llama.cpp context, driven by one scheduler thread.

Glossary (after llama.cpp's server and vLLM):
- *session*: a conversation's cache, keyed by id, owned by a principal (``session.py``).
- *sequence*: one of the context's KV sequences (``EngineOptions.sequences``); a hot session
  (resident in the KV pool, running or idle) holds one.
- *request*: one Generate or Warmup of a session, with an explicit state (``requests.py``).
- *step*: the scheduler decides who runs with how many tokens and makes room
  (``scheduler.py``, ``kv.py``), the runner runs one ``llama_decode`` (``runner.py``), the
  output stage turns each sampled row into an outcome (``output.py``) and the scheduler
  applies the outcomes (stream text, end requests).

This module keeps the public API (any thread) and the scheduler thread's loop. Rules: only
the scheduler thread touches the llama context, KV memory and the scheduler's queues;
callers render and tokenize on their own threads, then ``submit`` into an inbox (under the
engine's lock) and read a :class:`RequestStream`. Session operations that touch KV memory are
typed commands (``commands.py``) queued to the same thread. After each step the thread
publishes an immutable :class:`EngineStats`, so readers never see its structures mid-change.
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
from typing import Any

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate, builtin_template
from hotloop_serve.engine.commands import (
    ClearSession,
    CloseSession,
    Command,
    DropIfStale,
    ForkSession,
    PlaceImport,
    Queued,
    ReleaseSession,
    SnapshotAll,
    SnapshotSession,
    T,
)
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.grammar import GrammarProbe
from hotloop_serve.engine.kv import RESTORE_MARGIN, KVManager, common_prefix
from hotloop_serve.engine.kv_state import check_state
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.output import OutputProcessor
from hotloop_serve.engine.persist import BlobKeys, DiskStore, SessionBlob, model_fingerprint, to_kv_bytes
from hotloop_serve.engine.prompt_fit import fit_prompt
from hotloop_serve.engine.prompt_tokens import PromptTokenizer
from hotloop_serve.engine.requests import Request, RequestKind, RequestState
from hotloop_serve.engine.runner import ModelRunner, Runner
from hotloop_serve.engine.sampling import Sampler
from hotloop_serve.engine.scheduler import BatchPlan, Scheduler
from hotloop_serve.engine.session import KVBytes, Session, SessionPhase, SessionRegistry
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import RequestStream
from hotloop_serve.engine.tools import ToolSpec
from hotloop_serve.errors import (
    FailedPrecondition,
    HotloopError,
    InvalidArgument,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "SessionInfo"]

RunnerFactory = Callable[[Model, EngineOptions], Runner]
OutputFactory = Callable[[Model, Runner], OutputProcessor]
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
        runner: RunnerFactory = ModelRunner,
        model: Model | None = None,
        output: OutputFactory | None = None,
    ) -> None:
        """``runner`` builds the model runner from the loaded model (tests and benchmarks pass a
        subclass of :class:`ModelRunner` that records or slows its steps). ``model``: the model
        already loaded from ``model_path`` (the engine closes it); ``output``: the output stage
        (default: sampling the runner's logits). The synthetic engine (``synthetic.py``) passes
        all three."""
        self.options = opts = options or EngineOptions()
        self.blob_keys = blob_keys or BlobKeys.ephemeral()
        """Sign exported and persisted caches and verify imported ones (``persist.py``): by
        default a key of this engine alone, so it loads no blob it did not make."""
        self.defaults = default_settings or SamplingSettings()
        self.sessions_per_owner = sessions_per_owner
        self.max_sample_len = max_sample_len
        self.model = model or Model(
            model_path, gpu_layers=opts.gpu_layers, repack=not (opts.batch_invariant or opts.deterministic)
        )
        meta = self.model.metadata
        per_seq = opts.context_tokens // opts.hot_sessions if opts.kv_layout == "per_session" else opts.context_tokens
        if opts.deterministic:
            per_seq -= 1  # a cell of each stream stays free for a shadow row (engine/canonical.py)
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
        self.runner = runner(self.model, opts)
        self.output = output(self.model, self.runner) if output else OutputProcessor(self.model, self.runner.ctx)
        self.kv = KVManager(
            self.runner.memory,
            sequences=opts.sequences,
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
            session_context=self.session_context,
            step_target_ms=opts.step_target_ms,
            fair_prefill=opts.prefill_policy == "fair",
            followup_slot_s=opts.followup_slot_ms / 1e3,
        )

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._sessions = SessionRegistry(opts.max_sessions, sessions_per_owner)
        self._inbox: deque[Request] = deque()
        """Submitted requests the scheduler thread has not taken yet (guarded by the lock)."""
        self._commands: deque[Queued] = deque()
        self._order = itertools.count()
        self._rng = random.Random(opts.seed or None)
        self._stopping = False
        self._failure: BaseException | None = None
        self._last_housekeeping = time.monotonic()
        self._expected: dict[Session, float] = {}
        """Sessions whose reply just ended and whose client comes back quickly: until when the
        next step waits for their next turn (see ``EngineOptions.followup_wait_ms``)."""
        self._stats = EngineStats(free_sequences=opts.sequences)
        self._thread = threading.Thread(target=self._run, name="hotloop-scheduler", daemon=True)
        self._thread.start()

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
        self._call(ClearSession(s))
        with self._lock:
            return self._info(s)

    def close_session(self, session_id: str, owner: str) -> None:
        """Forget a session; a running request of it is cancelled."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)
        self._call(CloseSession(s))

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
        tools: Sequence[ToolSpec] = (),
    ) -> RequestStream:
        """Prefill ``messages`` (and the ``tools`` offered, as :meth:`generate` renders them) into
        the session's cache without generating.

        Warmup only adds: if the cache already starts with these messages (a system prompt
        warmed up again mid-conversation), nothing is cut.
        """
        return self._submit(RequestKind.WARMUP, session_id, owner, messages, settings, tools)

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
        self._call(ForkSession(src, dst, keep))
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
        tokens, data = self._call(ReleaseSession(s))
        if data is None:
            return None
        return SessionBlob(self.fingerprint, tokens, s.settings, bytes(data)).encode(self.blob_keys)

    def export_session(self, session_id: str, owner: str) -> bytes:
        """The session's cache as a portable blob (tokens, KV state, settings, model fingerprint)."""
        with self._lock:
            s = self._sessions.owned(session_id, owner)
        tokens, data = self._call(SnapshotSession(s))
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
            if not self._call(DropIfStale(s, tokens)):
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

        if not self._call(PlaceImport(s, blob.tokens, blob.kv, keep_tokens)):
            self._call(CloseSession(s))
            raise InvalidArgument("session export could not be loaded into the KV cache (its state is invalid)")
        return self.session_info(session_id, owner)

    def check_state(self, kv: bytes, n_tokens: int) -> None:
        """InvalidArgument unless ``kv`` is this model's state of exactly ``n_tokens`` tokens
        (``kv_state.check_state``), checked before llama.cpp reads a byte of it: a state whose
        cells do not continue its tokens would fail every session's decode in the next batch."""
        memory = self.runner.memory
        calibrated = getattr(memory, "calibrated", None)  # a test runner's memory may learn nothing
        if calibrated is not None:
            calibrated.wait(timeout=60.0)
        layout = getattr(memory, "layout", None)
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
            **self.scheduler.usage,
        )

    def close(self) -> None:
        """Stop the scheduler (failing what is in flight) and free llama.cpp's memory.

        With a disk tier, every cached session is written to it first, so a restarted server
        resumes them from disk.
        """
        if self.disk is not None and self.alive:
            try:
                self._call(SnapshotAll())
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
        self.runner.close()
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
        generate = kind is RequestKind.GENERATE
        prompt = fit_prompt(
            prompt,
            messages,
            settings,
            self.session_context,
            generate,
            lambda kept: self.render(kept, add_generation_prompt=generate, tools=tools),
        )
        # Built here, not under the lock: a grammar sampler's build is llama.cpp parsing the
        # grammar, and the scheduler thread must never wait on it.
        sampler = Sampler(settings, self.model.n_vocab, self._rng, self.model.vocab) if generate else None
        try:
            with self._lock:
                self._check_alive()
                session, _ = self._sessions.get_or_create(session_id, owner, settings)
                if session.finished_at:
                    session.return_s = time.perf_counter() - session.finished_at
                    session.finished_at = 0.0
                queued = len(self._inbox) + self.scheduler.waiting_count
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
                session.last_used = time.monotonic()
                self._inbox.append(req)
                self._wakeup.notify()
        except BaseException:
            if sampler is not None:
                sampler.free()
            raise
        return req.stream

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

    def _call(self, cmd: Command[T]) -> T:
        """Run ``cmd`` on the scheduler thread (it owns KV memory) and wait for its result."""
        queued = Queued(cmd)
        with self._lock:
            self._check_alive()
            self._commands.append(queued)
            self._wakeup.notify()
        result: T = queued.future.result()
        return result

    # ------------------------------------------------------------------ scheduler thread
    def _has_work(self) -> bool:
        return bool(self._inbox or self._commands or self.scheduler.has_work)

    def _run(self) -> None:
        try:
            # Every llama_decode runs on this thread, the calibration's too (see LlamaKVMemory.calibrate).
            self.runner.memory.calibrate()
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
                for queued in commands:
                    try:
                        queued.future.set_result(self._execute(queued.command))
                    except BaseException as e:
                        queued.future.set_exception(e)
                plan = self.scheduler.schedule()
                if plan.new_tokens:
                    self._step(plan)
                self._publish()
                if not plan.new_tokens and self.scheduler.waiting_count:
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
                for req in self._inbox:
                    self.scheduler.add(req)
                self._inbox.clear()
                commands = list(self._commands)
                self._commands.clear()
            self.scheduler.fail_all(error)
            for queued in commands:
                queued.future.set_exception(error)
            self._publish()

    def _step(self, plan: BatchPlan) -> None:
        """One step past the plan: the runner executes it, the output stage turns each row of
        logits into an outcome, the scheduler applies the outcomes."""
        batch = self.scheduler.batch(plan)
        out = self.runner.execute(batch.pieces)
        process = self.output.process
        outcomes = [
            None if row is None else process(req, row) for req, row in zip(batch.requests, out.logits, strict=True)
        ]
        ended = self.scheduler.update_from_output(batch, out, outcomes)
        if ended:
            wait = self._followup_wait_s()
            for s in ended:
                if wait > 0 and (s.return_s is None or s.return_s <= wait):
                    self._expected[s] = s.finished_at + wait

    def _await_followups(self) -> None:
        """Hold the next step briefly for the next turns of quick clients whose replies just ended.

        Their next request typically lands a few milliseconds after the reply's final chunk,
        just after the next step started: it would wait that whole step, then take another.
        Waiting only when other requests share the engine (alone, a step is short anyway), only
        for clients that came back this fast last time, and at most a fraction of a step keeps
        the cost to the others small (bench/replay.py measures both sides).
        """
        expected = self._expected
        if all(s in expected for s in self.scheduler.running_sessions()):
            expected.clear()
            return
        with self._lock:
            while expected and not (self._stopping or self._commands):
                now = time.perf_counter()
                arrived = {r.session for r in self._inbox}  # submitted, not yet taken by the scheduler
                for s in [s for s, until in expected.items() if s.pending or s in arrived or s.closed or until <= now]:
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
            active_requests=sched.running_count + sched.waiting_count,
            waiting_requests=sched.waiting_count,
            free_sequences=kv.free_sequences,
            kv_tokens=kv.used(),
            steps=sched.steps,
            preempted_requests=sched.preempted_count,
            evictions=c["evictions"],
            preemptions=c["preemptions"],
            restores=c["restores"],
            drops=c["drops"],
            window_resets=c["window_resets"],
            forks=c["forks"],
            disk_restores=c["disk_restores"],
        )

    def _housekeeping(self) -> None:
        """Forget sessions idle past their TTL, at most once a second, under load too (lock held).

        The decision and the session's removal from the registry happen here, under the lock
        and after the inbox was read, so no request can reach a session the TTL is forgetting;
        its memory is freed by a command (the TTL frees memory; a persisted copy may still serve).
        """
        now = time.monotonic()
        if now - self._last_housekeeping < 1.0:
            return
        self._last_housekeeping = now
        for s in self._sessions.idle_past(self.options.idle_ttl_s, now):
            if self._claim(s):
                self._commands.append(Queued(CloseSession(s, keep_on_disk=True)))

    def _claim(self, s: Session) -> bool:
        """Remove an idle session from the registry (lock held): False, keeping it, when a request
        holds it, waits for it, or sits in the inbox for it. ``Session.pending`` is the
        scheduler's and counts only what it was handed; the inbox is read here, under the lock."""
        if s.busy or any(r.session is s for r in self._inbox):
            return False
        self._sessions.remove(s)
        return True

    def _execute(self, cmd: Command[Any]) -> Any:
        """Run one command (scheduler thread)."""
        match cmd:
            case ClearSession(session=s):
                self.scheduler.end_session_request(s, "cleared")
                if not s.closed:
                    self.kv.clear(s)
                self._delete_persisted(s)
                return None
            case CloseSession(session=s, keep_on_disk=keep):
                self._forget(s, keep_on_disk=keep)
                return None
            case ForkSession(source=src, target=dst, keep=keep):
                n = len(src.tokens) if keep is None else common_prefix(src.tokens, keep)
                self.kv.fork(src, dst, n, self.scheduler.running_sessions())
                return None
            case ReleaseSession(session=s):
                return self._release(s)
            case SnapshotSession(session=s):
                return self.kv.snapshot(s, leaving=True)
            case DropIfStale(session=s, tokens=longer):
                if s.context_tokens >= longer:
                    return False
                with self._lock:
                    if not self._claim(s):
                        return False
                self._forget(s)
                return True
            case PlaceImport():
                return self._place_import(cmd)
            case SnapshotAll():
                for s in self._sessions.values():
                    tokens, data = self.kv.snapshot(s, leaving=True)
                    if data is not None and tokens:
                        self._spill(s, tokens, data)
                return None
        raise TypeError(f"unknown engine command {cmd!r}")

    def _release(self, s: Session) -> tuple[list[int], KVBytes | None]:
        with self._lock:
            busy = s.busy or any(r.session is s for r in self._inbox)
        if busy:
            return [], None
        tokens, data = self.kv.snapshot(s, leaving=True)
        if data is None:
            return tokens, None
        data = to_kv_bytes(bytes(data))  # a copy: forgetting frees the original
        with self._lock:
            if not self._claim(s):  # a request for it arrived meanwhile: it stays here
                return [], None
        self._forget(s)
        return tokens, data

    def _place_import(self, cmd: PlaceImport) -> bool:
        """Load an imported cache into its new session (see :meth:`import_session`)."""
        s = cmd.session
        if not cmd.kv:
            return True
        self.kv.adopt(s, cmd.tokens, to_kv_bytes(cmd.kv))
        protect = self.scheduler.running_sessions()
        if not self.kv.acquire(s, protect):
            # Every sequence is decoding: the blob (checked by ``check_state``) waits in host RAM
            # as an evicted session and is restored on its next turn. A fork's cut needs the
            # cells, so a fork made now starts cold instead (rebuilt from its history).
            if cmd.keep is not None:
                self.kv.forget(s)
                s.phase = SessionPhase.NEW
            return True
        ok = self.kv.restore(s, protect) == len(cmd.tokens) > 0
        if ok and cmd.keep is not None:
            self.kv.cut(s, common_prefix(s.tokens, cmd.keep))
        return ok

    def _delete_persisted(self, s: Session) -> None:
        if self.disk is not None and self._writer is not None:
            self._writer.submit(self.disk.delete, s.id)  # queued after any write of it: ordered
            s.disk = False

    def _forget(self, s: Session, keep_on_disk: bool = False) -> None:
        self.scheduler.end_session_request(s, "closed")
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
