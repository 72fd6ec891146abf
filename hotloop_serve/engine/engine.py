"""The engine: many hot sessions over one llama.cpp context, driven by one scheduler thread.

Glossary (after llama.cpp's server):
- *session*: a conversation's cache, keyed by id, owned by a principal (``session.py``).
- *sequence*: one of the context's ``hot_sessions`` KV sequences; a hot session holds one.
- *request*: one Generate or Warmup of a session: its prompt tokens, sampler and stream.
- *step*: plan a batch (``scheduler.plan_batch``), run it (one ``llama_decode``), apply the
  results (sample, stream text, finish).

Rules: only the scheduler thread touches the llama context and KV memory; callers render
and tokenize on their own threads, then ``submit`` and read a :class:`RequestStream`.
Commands that touch KV memory (clear, close) are queued to the scheduler too.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import llama_cpp as ll

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate, builtin_template
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.sampling import Sampler, TextAssembler
from hotloop_serve.engine.scheduler import plan_batch
from hotloop_serve.engine.session import EvictedStore, SessionState
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import Chunk, RequestStream, Timings, Usage
from hotloop_serve.errors import (
    Cancelled,
    FailedPrecondition,
    HotloopError,
    InternalError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_GENERATE, _WARMUP = "generate", "warmup"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: histories are long and mostly equal.
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Request:
    """One Generate or Warmup in flight."""

    __slots__ = (
        "_wake",
        "assembler",
        "cancelled",
        "generated",
        "kind",
        "last_token",
        "prompt",
        "sampler",
        "session",
        "settings",
        "stream",
        "t_admit",
        "t_first",
        "t_submit",
        "tail",
        "usage",
    )

    def __init__(
        self,
        kind: str,
        session: SessionState,
        prompt: list[int],
        settings: SamplingSettings,
        wake: Callable[[], None],
    ) -> None:
        self._wake = wake
        self.kind = kind
        self.session = session
        self.prompt = prompt
        self.settings = settings
        self.stream: RequestStream = RequestStream(self._request_cancel)
        self.sampler: Sampler | None = None
        self.assembler = TextAssembler(settings.stop)
        self.usage = Usage(prompt_tokens=len(prompt))
        self.generated = 0
        self.last_token: int | None = None
        self.tail = False
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_admit = 0.0
        self.t_first = 0.0

    def _request_cancel(self) -> None:
        self.cancelled = True
        self._wake()

    @property
    def decoding(self) -> bool:
        return self.last_token is not None

    @property
    def needs_logits(self) -> bool:
        return self.kind == _GENERATE

    @property
    def prefill_remaining(self) -> int:
        return 0 if self.last_token is not None else len(self.prompt) - len(self.session.tokens)


@dataclass(frozen=True)
class SessionInfo:
    id: str
    owner: str
    settings: SamplingSettings
    context_tokens: int
    state: str


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics, health and leak checks."""

    sessions: int
    hot_sessions: int
    evicted_sessions: int
    evicted_bytes: int
    active_requests: int
    waiting_requests: int
    free_sequences: int
    kv_tokens: int
    steps: int


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
    ) -> None:
        self.options = opts = options or EngineOptions()
        self.defaults = default_settings or SamplingSettings()
        self.sessions_per_owner = sessions_per_owner
        self.max_sample_len = max_sample_len
        self.model = Model(model_path, gpu_layers=opts.gpu_layers, repack=not opts.batch_invariant)
        meta = self.model.metadata
        self.session_context = min(opts.session_context_tokens, meta.train_context_length or opts.context_tokens)
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

        params = ll.llama_context_default_params()
        params.n_ctx = opts.context_tokens
        params.n_batch = params.n_ubatch = opts.batch_tokens
        params.n_seq_max = opts.hot_sessions
        threads = opts.threads or len(os.sched_getaffinity(0))
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # sequences share one pool of cells: any session may grow to session_context
        params.swa_full = True  # keep sliding-window layers' cells too, so a cache can be cut anywhere
        params.no_perf = True
        if opts.batch_invariant:
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._ctx = ll.llama_init_from_model(self.model.ptr, params)
        if not self._ctx:
            raise InternalError(f"llama.cpp could not create a context of {opts.context_tokens} tokens")
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(opts.batch_tokens, 0, 1)

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._sessions: dict[str, SessionState] = {}
        self._inbox: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._free_seqs = list(range(opts.hot_sessions - 1, -1, -1))
        self._hot: dict[int, SessionState] = {}
        self._evicted = EvictedStore(opts.evicted_bytes)
        self._rng = random.Random(opts.seed or None)
        self._steps = 0
        self._stopping = False
        self._failure: BaseException | None = None
        self._last_housekeeping = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hotloop-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """History -> prompt tokens (on the caller's thread)."""
        text = self.template.render(messages, add_generation_prompt)
        tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        if self.model.add_bos and self._bos_text and not text.startswith(self._bos_text):
            tokens.insert(0, self.model.bos)
        return tokens

    def create_session(self, session_id: str, owner: str, settings: SamplingSettings | None = None) -> SessionInfo:
        """Register a session (idempotent for its owner); settings default to the server's."""
        settings = settings or self.defaults
        settings.validate(self.max_sample_len)
        with self._lock:
            s = self._get_or_create(session_id, owner, settings, replace_settings=True)
            return self._info(s)

    def session_info(self, session_id: str, owner: str) -> SessionInfo:
        with self._lock:
            return self._info(self._owned(session_id, owner))

    def settings_of(self, session_id: str, owner: str) -> SamplingSettings:
        """A session's settings, or the server's defaults for a session this replica does not hold."""
        with self._lock:
            s = self._sessions.get(session_id)
            return s.settings if s is not None and s.owner == owner else self.defaults

    def known(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def update_settings(self, session_id: str, owner: str, settings: SamplingSettings) -> SessionInfo:
        settings.validate(self.max_sample_len)
        with self._lock:
            s = self._get_or_create(session_id, owner, settings, replace_settings=True)
            return self._info(s)

    def clear_cache(self, session_id: str, owner: str) -> SessionInfo:
        """Empty a session's cache (its settings stay)."""
        with self._lock:
            s = self._owned(session_id, owner)
        self._call(lambda: self._drop_cache(s))
        with self._lock:
            return self._info(s)

    def close_session(self, session_id: str, owner: str) -> None:
        """Forget a session; a running request of it is cancelled."""
        with self._lock:
            s = self._owned(session_id, owner)
            if s.request is not None:
                s.request.cancelled = True
        self._call(lambda: self._forget(s))

    def generate(
        self,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None = None,
    ) -> RequestStream:
        """Start a reply to ``messages``; read it from the returned stream."""
        return self._submit(_GENERATE, session_id, owner, messages, settings)

    def warmup(
        self,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None = None,
    ) -> RequestStream:
        """Prefill ``messages`` into the session's cache without generating."""
        return self._submit(_WARMUP, session_id, owner, messages, settings)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                sessions=len(self._sessions),
                hot_sessions=len(self._hot),
                evicted_sessions=len(self._evicted),
                evicted_bytes=self._evicted.bytes,
                active_requests=len(self._active) + len(self._inbox),
                waiting_requests=len(self._waiting),
                free_sequences=len(self._free_seqs),
                kv_tokens=sum(len(s.tokens) for s in self._hot.values()),
                steps=self._steps,
            )

    def close(self) -> None:
        """Stop the scheduler (failing what is in flight) and free llama.cpp's memory."""
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
        self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ submission helpers
    def _submit(
        self,
        kind: str,
        session_id: str,
        owner: str,
        messages: Sequence[ChatMessage],
        settings: SamplingSettings | None,
    ) -> RequestStream:
        if not messages:
            raise InvalidArgument("history is empty: send at least one message")
        with self._lock:
            existing = self._sessions.get(session_id)
            base = existing.settings if existing is not None and existing.owner == owner else self.defaults
        settings = settings or base
        settings.validate(self.max_sample_len)
        prompt = self.render(messages, add_generation_prompt=kind == _GENERATE)
        prompt = self._fit(prompt, messages, settings, kind)
        with self._lock:
            if self._stopping or self._failure is not None:
                raise Unavailable("the engine is shutting down or failed; retry on another replica")
            session = self._get_or_create(session_id, owner, settings, replace_settings=False)
            running = session.request
            if running is not None and not (running.cancelled or running.tail or running.stream.finished):
                raise FailedPrecondition(
                    f"session {session_id} is already generating; wait for that reply or cancel it first"
                )
            if len(self._inbox) + len(self._waiting) >= self.options.max_queue:
                raise ResourceExhausted(
                    f"replica queue is full (engine.max_queue={self.options.max_queue} waiting requests); retry later"
                )
            req = Request(kind, session, prompt, settings, self._wake)
            self._inbox.append(req)
            self._wakeup.notify()
        return req.stream

    def _fit(
        self, prompt: list[int], messages: Sequence[ChatMessage], settings: SamplingSettings, kind: str
    ) -> list[int]:
        """Check the prompt fits the session's window; drop the oldest turns if the settings allow it."""
        limit = self.session_context - (1 if kind == _GENERATE else 0)
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
        while len(msgs) > keep_system + 1:
            del msgs[keep_system]
            prompt = self.render(msgs, add_generation_prompt=kind == _GENERATE)
            if len(prompt) + headroom <= self.session_context:
                return prompt
        if len(prompt) <= limit:
            return prompt
        raise OutOfRange(
            f"the last message alone renders to {len(prompt)} tokens, over the session window of "
            f"{self.session_context}; shorten it"
        )

    def _get_or_create(
        self, session_id: str, owner: str, settings: SamplingSettings, replace_settings: bool
    ) -> SessionState:
        """Look up (or create) a session under the lock."""
        s = self._sessions.get(session_id)
        if s is not None:
            if s.owner != owner:
                raise NotFound(f"session {session_id} not found")
            if replace_settings:
                s.settings = settings
            return s
        if len(self._sessions) >= self.options.max_sessions:
            raise ResourceExhausted(
                f"this replica holds its maximum of {self.options.max_sessions} sessions "
                f"(engine.max_sessions); close sessions you no longer use"
            )
        if self.sessions_per_owner is not None:
            mine = sum(1 for x in self._sessions.values() if x.owner == owner)
            if mine >= self.sessions_per_owner:
                raise ResourceExhausted(
                    f"principal {owner!r} already has {mine} sessions on this replica "
                    f"(limits.sessions_per_principal={self.sessions_per_owner}); close some first"
                )
        s = self._sessions[session_id] = SessionState(session_id, owner, settings)
        return s

    def _owned(self, session_id: str, owner: str) -> SessionState:
        s = self._sessions.get(session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id} not found")
        return s

    @staticmethod
    def _info(s: SessionState) -> SessionInfo:
        return SessionInfo(s.id, s.owner, s.settings, s.context_tokens, s.state)

    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread (it owns KV memory) and wait for it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                raise Unavailable("the engine is shutting down")
            self._commands.append((fn, fut))
            self._wakeup.notify()
        return fut.result(timeout=60)

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._inbox or self._commands or self._active or self._waiting):
                        self._wakeup.wait(timeout=1.0)
                        self._housekeeping()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:
                        fut.set_exception(e)
                self._reap_cancelled()
                self._admit()
                if self._active:
                    self._step()
                elif self._waiting:
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
                error = InternalError(f"engine failure: {self._failure}")
            with self._lock:
                pending = [*self._active, *self._waiting, *self._inbox]
                self._active.clear()
                self._waiting.clear()
                self._inbox.clear()
                commands = list(self._commands)
                self._commands.clear()
            for req in pending:
                self._end(req, error)
            for _, fut in commands:
                fut.set_exception(error)

    def _housekeeping(self) -> None:
        """Forget sessions idle past their TTL (called under the lock, at most once a second)."""
        now = time.monotonic()
        if now - self._last_housekeeping < 1.0:
            return
        self._last_housekeeping = now
        ttl = self.options.idle_ttl_s
        for s in [s for s in self._sessions.values() if s.request is None and now - s.last_used > ttl]:
            self._commands.append((lambda s=s: self._forget(s), concurrent.futures.Future()))  # type: ignore[misc]

    def _reap_cancelled(self) -> None:
        keep = []
        for req in self._active:
            if req.cancelled and not req.tail:
                self._release(req)
                req.stream.put(Cancelled("request cancelled"))  # nobody reads it; closes the stream
            else:
                keep.append(req)
        self._active = keep
        for req in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(req)
            req.stream.put(Cancelled("request cancelled"))

    def _admit(self) -> None:
        """Move waiting requests into the batch when their session is free and a sequence is available."""
        if not self._waiting:
            return
        still: deque[Request] = deque()
        while self._waiting:
            req = self._waiting.popleft()
            s = req.session
            if s.closed:
                req.stream.put(NotFound(f"session {s.id} was closed"))
                continue
            if (s.request is not None and s.request is not req) or len(self._active) >= self.options.hot_sessions:
                still.append(req)
                continue
            if s.seq is None and not self._take_sequence(s):
                still.append(req)
                continue
            try:
                self._start(req)
            except HotloopError as e:
                self._end(req, e)
        self._waiting = still

    def _take_sequence(self, s: SessionState) -> bool:
        """Give ``s`` a sequence, evicting the least recently used idle hot session if needed."""
        if not self._free_seqs:
            idle = [h for h in self._hot.values() if h.request is None]
            if not idle:
                return False
            self._evict(min(idle, key=lambda h: h.last_used))
        seq = self._free_seqs.pop()
        if s.saved is None:
            s.tokens = []  # dropped (or new): nothing of it is in the cache any more
        s.seq = seq
        self._hot[seq] = s
        return True

    def _evict(self, s: SessionState) -> None:
        """Move a hot session's KV to host RAM (or drop it past the budget); free its sequence."""
        seq = s.seq
        assert seq is not None
        if s.tokens and self._evicted.budget > 0:
            size = ll.llama_state_seq_get_size(self._ctx, seq)
            buf = (ctypes.c_uint8 * size)()
            written = ll.llama_state_seq_get_data(self._ctx, buf, size, seq)
            if written:
                self._evicted.put(s, buf)
            else:
                s.tokens = []
        else:
            s.tokens = []
        ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
        del self._hot[seq]
        s.seq = None
        self._free_seqs.append(seq)

    def _kv_used(self) -> int:
        return sum(len(h.tokens) for h in self._hot.values())

    def _start(self, req: Request) -> None:
        """Admit a request: restore or reuse the session's cache, cut it to the common prefix."""
        s = req.session
        seq = s.seq
        assert seq is not None
        s.request = req
        req.t_admit = time.perf_counter()
        prompt = req.prompt
        restored = False
        data = self._evicted.take(s)
        if data is not None:
            if ll.llama_state_seq_set_data(self._ctx, data, len(data), seq):
                restored = True
            else:
                s.tokens = []
        reuse = common_prefix(s.tokens, prompt)
        if req.kind == _GENERATE and reuse == len(prompt):
            reuse -= 1  # the last prompt token must be decoded again to get its logits
        if reuse < len(s.tokens):
            if not ll.llama_memory_seq_rm(self._mem, seq, reuse, -1):
                ll.llama_memory_seq_rm(self._mem, seq, -1, -1)
                reuse = 0
            del s.tokens[reuse:]
        shared = 0
        if reuse == 0:
            shared = self._copy_shared_prefix(s, prompt, req.kind)
        if restored:
            req.usage.restored_tokens = reuse
        else:
            req.usage.cached_tokens = reuse + shared
        req.usage.prefilled_tokens = len(prompt) - reuse - shared
        # Room in the shared pool of cells: evict idle sessions until this request fits.
        need = len(prompt) - len(s.tokens) + (req.settings.sample_len if req.kind == _GENERATE else 0)
        need = min(need, self.session_context - len(s.tokens))
        while self._kv_used() + need > self.options.context_tokens:
            idle = [h for h in self._hot.values() if h.request is None]
            if not idle:
                break
            self._evict(min(idle, key=lambda h: h.last_used))
        if req.kind == _GENERATE:
            req.sampler = Sampler(req.settings, self.model.n_vocab, prompt, self._rng)
        self._active.append(req)
        if req.kind == _WARMUP and req.prefill_remaining == 0:
            self._finish(req, "eos", decode_tail=False)

    def _copy_shared_prefix(self, s: SessionState, prompt: list[int], kind: str) -> int:
        """Copy the longest common prefix from another hot session of the same owner (seq_cp)."""
        best, best_n = None, 0
        for other in self._hot.values():
            if other is s or other.owner != s.owner:
                continue
            n = common_prefix(other.tokens, prompt)
            if n > best_n:
                best, best_n = other, n
        if kind == _GENERATE and best_n == len(prompt):
            best_n -= 1
        if best is None or best_n < self.options.shared_prefix_min_tokens:
            return 0
        assert best.seq is not None and s.seq is not None
        ll.llama_memory_seq_cp(self._mem, best.seq, s.seq, 0, best_n)
        s.tokens = prompt[:best_n]
        return best_n

    def _prune(self) -> None:
        """Drop requests that were released (finished, failed, cancelled) from the batch list."""
        self._active = [r for r in self._active if r.session.request is r]

    def _step(self) -> None:
        """Plan, decode, apply: one llama_decode for every active request."""
        self._prune()
        active = list(self._active)
        plan = plan_batch(active, self.options.batch_tokens, self.options.prefill_chunk)
        batch = self._batch
        n = 0
        outputs: list[tuple[Request, int]] = []
        for i in plan.decode:
            req = active[i]
            seq = req.session.seq
            assert seq is not None and req.last_token is not None
            batch.token[n] = req.last_token
            batch.pos[n] = len(req.session.tokens)
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = not req.tail
            if not req.tail:
                outputs.append((req, n))
            n += 1
        prefilled: list[tuple[Request, int]] = []
        for i, count in plan.prefill:
            req = active[i]
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
            prefilled.append((req, count))
            if start + count == len(req.prompt) and req.kind == _GENERATE:
                batch.logits[n - 1] = True
                outputs.append((req, n - 1))
        if n == 0:
            return
        batch.n_tokens = n
        rc = ll.llama_decode(self._ctx, batch)
        self._steps += 1
        if rc != 0:
            self._decode_failed(rc, [r for r, _ in prefilled] + [active[i] for i in plan.decode])
            return
        # Apply: the decoded tokens are now in the cache.
        for i in plan.decode:
            req = active[i]
            assert req.last_token is not None
            req.session.tokens.append(req.last_token)
            if req.tail:
                self._release(req)
        for req, count in prefilled:
            start = len(req.session.tokens)
            req.session.tokens.extend(req.prompt[start : start + count])
            if req.kind == _WARMUP and req.prefill_remaining == 0:
                self._finish(req, "eos", decode_tail=False)
        for req, index in outputs:
            self._sample(req, index)
        self._prune()

    def _sample(self, req: Request, index: int) -> None:
        assert req.sampler is not None
        now = time.perf_counter()
        if req.generated == 0:
            req.t_first = now
        token = req.sampler.sample(self._ctx, index)
        if self.model.is_eog(token):
            self._finish(req, "eos", decode_tail=True, token=token)
            return
        req.generated += 1
        text = req.assembler.feed(self.model.piece(token))
        if req.assembler.stopped:
            if text:
                req.stream.put(Chunk(text))
            self._finish(req, "stop", decode_tail=False)
            return
        if text:
            req.stream.put(Chunk(text))
        if req.generated >= req.settings.sample_len:
            self._finish(req, "length", decode_tail=True, token=token)
        elif len(req.session.tokens) + 1 >= self.session_context:
            self._finish(req, "context", decode_tail=False)
        else:
            req.last_token = token

    def _finish(self, req: Request, reason: str, decode_tail: bool, token: int | None = None) -> None:
        """Send the final chunk now; optionally keep the request one more step to cache its last token."""
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
        req.stream.put(Chunk(text, reason, req.usage, timings, cache_hit=hit))
        if req.sampler is not None:
            req.sampler.free()
            req.sampler = None
        fits = len(req.session.tokens) + 1 < self.session_context
        if decode_tail and token is not None and fits and not req.cancelled:
            req.tail = True
            req.last_token = token
        else:
            self._release(req)

    def _release(self, req: Request) -> None:
        """The request leaves the batch; its session becomes idle (its cache stays)."""
        if req.sampler is not None:
            req.sampler.free()
            req.sampler = None
        s = req.session
        if s.request is req:
            s.request = None
        s.last_used = time.monotonic()
        if s.closed:
            self._forget(s)

    def _end(self, req: Request, error: HotloopError) -> None:
        if req.sampler is not None:
            req.sampler.free()
            req.sampler = None
        if req.session.request is req:
            req.session.request = None
        req.stream.put(error)

    def _decode_failed(self, rc: int, requests: list[Request]) -> None:
        """llama_decode refused the batch: 1 = no room in the KV cache; anything else is fatal."""
        if rc < 0:
            raise RuntimeError(f"llama_decode failed with {rc}")
        victims = [r for r in requests if not r.decoding] or requests
        for req in victims:
            self._end(
                req,
                ResourceExhausted(
                    f"the replica's KV cache is full (engine.context_tokens={self.options.context_tokens}); "
                    "retry, or raise context_tokens"
                ),
            )
            self._drop_cache(req.session)
        self._prune()

    def _drop_cache(self, s: SessionState) -> None:
        """Empty a session's cache wherever it is (scheduler thread)."""
        if s.request is not None and not s.request.tail:
            s.request.cancelled = True
            self._reap_cancelled()
        if s.request is not None:
            self._release(s.request)
        self._evicted.take(s)
        if s.seq is not None:
            ll.llama_memory_seq_rm(self._mem, s.seq, -1, -1)
        s.tokens = []

    def _forget(self, s: SessionState) -> None:
        """Remove a session entirely, freeing its sequence (scheduler thread)."""
        s.closed = True
        if s.request is not None and not s.request.tail:
            s.request.cancelled = True
            self._reap_cancelled()
        if s.request is not None:
            return  # the tail step releases it, then comes back here
        self._evicted.take(s)
        if s.seq is not None:
            ll.llama_memory_seq_rm(self._mem, s.seq, -1, -1)
            del self._hot[s.seq]
            self._free_seqs.append(s.seq)
            s.seq = None
        s.tokens = []
        with self._lock:
            if self._sessions.get(s.id) is s:
                del self._sessions[s.id]
