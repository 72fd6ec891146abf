"""The KV/sequence manager: which session holds which llama.cpp sequence, and where every cache is.

It owns admission to KV memory (a sequence and room in the pool of cells), eviction of idle
sessions to host RAM and their exact restore, pre-emption of running ones under memory
pressure, longest-prefix reuse and shared-prefix copies. It talks to llama.cpp only through
:class:`KVMemory`, a handful of memory calls, so every rule here is unit-tested with a fake
memory (``tests/unit/test_kv.py``); :class:`LlamaKVMemory` is the real one.

Sliding-window attention (Gemma 3: 5 of 6 layers see the last 512 positions). llama.cpp
reuses a sequence's sliding-window cells once they fall out of its window, even with a
full-size SWA cache, and saving a sequence keeps only its window. Cutting a cache back (an
edited turn) or copying a prefix into another sequence may then need cells that are gone,
and nothing in llama.cpp errors: the session would run without part of its context. So
after every cut or copy the manager counts the sliding-window cells the new end of the cache
needs (:meth:`KVMemory.window_cells`); if any is missing, the cache is rebuilt from scratch.
Recurrent and hybrid models cannot cut or copy part of a state at all: there only whole
caches are reused.

Accounting: a hot session occupies ``len(tokens)`` cells of the shared pool (an upper bound:
shared-prefix copies share cells). Before each step the scheduler asks for room for the
step's tokens; idle sessions are evicted first, then running requests are pre-empted.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import llama_cpp as ll

from hotloop_serve.engine.kv_state import StateError, StateLayout, learn_layout
from hotloop_serve.engine.session import EvictedStore, KVBytes, Session, SessionPhase

log = logging.getLogger(__name__)


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


class KVMemory(Protocol):
    """The llama.cpp memory operations the manager needs, one sequence at a time."""

    @property
    def n_swa(self) -> int:
        """Sliding-window size of the model (0: none)."""

    @property
    def partial_ok(self) -> bool:
        """Whether part of a sequence can be removed or copied (False for recurrent/hybrid models)."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool: ...

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def window_cells(self, seq: int) -> int:
        """Cells the sliding-window cache holds for ``seq`` within the window of its last position."""

    def save(self, seq: int) -> KVBytes | None: ...

    def restore(self, seq: int, data: KVBytes) -> bool: ...


class LlamaKVMemory:
    """:class:`KVMemory` over a llama.cpp context."""

    def __init__(self, ctx: ll.llama_context_p, model: ll.llama_model_p, probe_token: int) -> None:
        self._ctx = ctx
        self._mem = ll.llama_get_memory(ctx)
        self._n_swa = int(ll.llama_model_n_swa(model))
        self._partial_ok = not (ll.llama_model_is_recurrent(model) or ll.llama_model_is_hybrid(model))
        self._cell_bytes = 0
        self._base_bytes = 0
        self._probe_token = probe_token
        self.layout: StateLayout | None = None
        """How this context writes a sequence's state (None: not learned; see :meth:`calibrate`)."""
        self.calibrated = threading.Event()

    def calibrate(self) -> None:
        """Learn the layout of a sequence's saved state and size sliding-window cells (see
        :meth:`_learn_layout`, :meth:`_calibrate`). Call it on the thread that runs every
        other decode: once a thread has run llama.cpp's CPU kernels, its idle OpenMP team slows
        decodes from any other thread."""
        try:
            if self._partial_ok and self.layout is None:
                self._learn_layout(self._probe_token)
            if self._n_swa > 0 and self._partial_ok and not self._cell_bytes:
                self._calibrate(self._probe_token)
        finally:
            self.calibrated.set()

    def _learn_layout(self, token: int) -> None:
        """The state layout of this context (``kv_state.learn_layout``), from a one-token sequence:
        what every imported or persisted state is checked against before llama.cpp reads it."""
        batch = ll.llama_batch_init(1, 0, 1)
        try:
            batch.n_tokens = 1
            batch.token[0] = token
            batch.pos[0] = 0
            batch.n_seq_id[0] = 1
            batch.seq_id[0][0] = 0
            batch.logits[0] = False
            if ll.llama_decode(self._ctx, batch) != 0:
                return
            data = self.save(0)
            if data is not None:
                self.layout = learn_layout(bytes(data))
        except StateError as e:
            log.warning("could not learn the KV state layout (%s); imports are checked by signature only", e)
        finally:
            ll.llama_memory_seq_rm(self._mem, 0, -1, -1)
            ll.llama_batch_free(batch)

    @property
    def n_swa(self) -> int:
        return self._n_swa if self._cell_bytes else 0

    @property
    def partial_ok(self) -> bool:
        return self._partial_ok

    def _calibrate(self, token: int) -> None:
        """Learn the sliding-window state size of one cell by decoding two tokens into sequence 0.

        A sequence's SWA-only state is ``base + cells * cell_bytes`` bytes (llama.cpp writes the
        same header and per-cell rows whatever the layout), so its size counts its cells.
        """
        batch = ll.llama_batch_init(1, 0, 1)
        sizes = []
        try:
            for pos in range(2):
                batch.n_tokens = 1
                batch.token[0] = token
                batch.pos[0] = pos
                batch.n_seq_id[0] = 1
                batch.seq_id[0][0] = 0
                batch.logits[0] = False
                if ll.llama_decode(self._ctx, batch) != 0:
                    return
                sizes.append(self._swa_size(0))
        finally:
            ll.llama_memory_seq_rm(self._mem, 0, -1, -1)
            ll.llama_batch_free(batch)
        self._cell_bytes = sizes[1] - sizes[0]
        self._base_bytes = sizes[0] - self._cell_bytes
        if self._cell_bytes <= 0:
            log.warning("could not size sliding-window cells; edited turns will re-prefill from scratch")
            self._cell_bytes = 0

    def _swa_size(self, seq: int) -> int:
        return int(ll.llama_state_seq_get_size_ext(self._ctx, seq, ll.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY))

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        return bool(ll.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def pos_max(self, seq: int) -> int:
        """The last position cached for ``seq`` (-1: none)."""
        return int(ll.llama_memory_seq_pos_max(self._mem, seq))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def window_cells(self, seq: int) -> int:
        if not self._cell_bytes:
            return 0
        return (self._swa_size(seq) - self._base_bytes) // self._cell_bytes

    def save(self, seq: int) -> KVBytes | None:
        size = ll.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        return buf if ll.llama_state_seq_get_data(self._ctx, buf, size, seq) else None

    def restore(self, seq: int, data: KVBytes) -> bool:
        return bool(ll.llama_state_seq_set_data(self._ctx, data, len(data), seq))


RESTORE_MARGIN = 4
"""Tokens a saved cache leaves off its end (sliding-window models with a full-size window cache).

llama.cpp restores a sequence's sliding-window cells only within the window of its last
position (measured: 754 cached tokens restore with exactly 512 window cells). Continuing at
the full length works; cutting even one token then lacks a window cell, and the whole cache
is rebuilt. A follow-up often cuts one or two: the previous reply's last tokens re-render
differently in the next history. Saving without the last 4 tokens lets such a follow-up
continue from the restored cache. The margin is small because each restore prefills it again:
a larger one made a restored follow-up markedly slower than a hot one (``bench/sessions.py``)."""


class KVManager:
    """Sequences, cells and RAM for one engine's sessions. Scheduler thread only."""

    def __init__(
        self,
        memory: KVMemory,
        *,
        sequences: int,
        capacity_tokens: int,
        evicted_bytes: int,
        shared_prefix_min_tokens: int,
        pooled: bool = True,
        spill: Callable[[Session, list[int], KVBytes], None] | None = None,
        restore_margin: int = 0,
    ) -> None:
        self.memory = memory
        self.restore_margin = restore_margin
        """:data:`RESTORE_MARGIN` where it helps (a full-size window cache), else 0."""
        self.spill = spill
        """Called with an idle session's tokens and KV when host RAM drops it (the disk tier)."""
        self.capacity = capacity_tokens
        """Cells all hot sessions share (unified layout); per-sequence layouts never contend."""
        self.pooled = pooled
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        self.evicted = EvictedStore(evicted_bytes)
        self._free = list(range(sequences - 1, -1, -1))
        self.hot: dict[int, Session] = {}
        self.counters = {"evictions": 0, "drops": 0, "preemptions": 0, "restores": 0, "restore_failures": 0,
                         "window_resets": 0, "forks": 0, "disk_restores": 0}  # fmt: skip

    # -- reading --
    @property
    def free_sequences(self) -> int:
        return len(self._free)

    def used(self) -> int:
        return sum(len(s.tokens) for s in self.hot.values())

    def fits(self, tokens: int) -> bool:
        return not self.pooled or self.used() + tokens <= self.capacity

    def _idle_hot(self, protect: Iterable[Session]) -> list[Session]:
        keep = {id(s) for s in protect}
        return [s for s in self.hot.values() if s.request is None and id(s) not in keep]

    # -- making room --
    def evict_lru(self, protect: Iterable[Session] = ()) -> bool:
        """Evict the least recently used idle hot session; False when there is none."""
        idle = self._idle_hot(protect)
        if not idle:
            return False
        self.evict(min(idle, key=lambda s: s.last_used))
        return True

    def make_room(self, tokens: int, protect: Iterable[Session] = ()) -> bool:
        """Evict idle sessions (LRU) until ``tokens`` more cells fit; False if they still do not."""
        protect = list(protect)
        while not self.fits(tokens):
            if not self.evict_lru(protect):
                return False
        return True

    def acquire(self, s: Session, protect: Iterable[Session] = ()) -> bool:
        """Give ``s`` a sequence (evicting an idle session if none is free); False if none can be had."""
        if s.seq is not None:
            return True
        if not self._free and not self.evict_lru([s, *protect]):
            return False
        seq = self._free.pop()
        s.seq = seq
        self.hot[seq] = s
        if s.phase is not SessionPhase.EVICTED:
            s.tokens = []  # new or dropped: nothing of it is in the cache
            s.window_floor = 0
            s.phase = SessionPhase.HOT
        return True

    def _release_seq(self, s: Session) -> None:
        seq = s.seq
        assert seq is not None
        self.memory.seq_rm(seq, -1, -1)
        del self.hot[seq]
        s.seq = None
        self._free.append(seq)

    def evict(self, s: Session, pinned: bool = False) -> None:
        """Move a hot session's KV to host RAM (or drop it past the budget); free its sequence.
        A pre-empted (``pinned``) one is saved whole: it resumes exactly where it was."""
        if not pinned:
            self._trim_for_restore(s)
        data = self.memory.save(s.seq) if s.tokens else None  # type: ignore[arg-type]
        self._release_seq(s)
        if data is None:
            self._lose(s)
            return
        self._keep_in_ram(s, data, pinned)
        if s.saved is data:
            s.phase = SessionPhase.EVICTED
            self.counters["preemptions" if pinned else "evictions"] += 1

    def _keep_in_ram(self, s: Session, data: KVBytes, pinned: bool) -> None:
        """Put ``s``'s KV in the RAM store; whatever it drops to make room goes to disk (if any), then is lost."""
        for old, old_data in self.evicted.put(s, data, pinned=pinned):
            if self.spill is not None and old.tokens:
                self.spill(old, list(old.tokens), old_data)
            self._lose(old)

    def _lose(self, s: Session) -> None:
        """The session's cache is gone; the next request rebuilds it from its history."""
        s.tokens = []
        s.window_floor = 0
        if s.phase is not SessionPhase.CLOSED:
            s.phase = SessionPhase.DROPPED
        self.counters["drops"] += 1

    def preempt(self, s: Session) -> None:
        """Save a running session's KV to RAM (kept whatever the budget) and free its cells."""
        self.evict(s, pinned=True)

    # -- admission --
    def restore(self, s: Session, protect: Iterable[Session] = ()) -> int:
        """Bring an evicted session's KV back into its (acquired) sequence; the tokens restored.

        Room is made first (llama.cpp needs a free cell per restored token); a restore that
        fails anyway leaves nothing half-written behind and the session is rebuilt instead.
        """
        data = self.evicted.take(s)
        if data is None:
            return 0
        assert s.seq is not None
        if self.pooled:
            self.make_room(len(s.tokens), [s, *protect])
        if self.memory.restore(s.seq, data):
            s.phase = SessionPhase.HOT
            s.window_floor = max(0, len(s.tokens) - self.memory.n_swa) if self.memory.n_swa else 0
            self.counters["restores"] += 1
            return len(s.tokens)
        self.counters["restore_failures"] += 1
        log.warning("restoring session %s (%d tokens) failed; rebuilding it", s.id, len(s.tokens))
        self.memory.seq_rm(s.seq, -1, -1)
        self._lose(s)
        s.phase = SessionPhase.HOT
        return 0

    def _window_intact(self, seq: int, n: int) -> bool:
        """Whether the sliding-window cells that continuing at position ``n`` needs are all there."""
        w = self.memory.n_swa
        if w == 0 or n == 0:
            return True
        return self.memory.window_cells(seq) >= min(n, w)

    def cut(self, s: Session, keep: int) -> int:
        """Keep the first ``keep`` cached tokens of a hot session; the count really kept (0: rebuilt)."""
        assert s.seq is not None
        if keep >= len(s.tokens):
            return len(s.tokens)
        ok = (keep > 0 and self.memory.partial_ok) and self.memory.seq_rm(s.seq, keep, -1)
        if ok and not self._window_intact(s.seq, keep):
            self.counters["window_resets"] += 1
            ok = False
        if not ok:
            self.memory.seq_rm(s.seq, -1, -1)
            keep = 0
            s.window_floor = 0
        del s.tokens[keep:]
        return keep

    def copy_prefix(self, s: Session, prompt: Sequence[int], limit: int) -> int:
        """Copy the longest cached prefix of ``prompt`` (at most ``limit`` tokens) from another hot
        session of the same owner into ``s`` (empty); the tokens copied."""
        assert s.seq is not None and not s.tokens
        if not self.pooled:
            return 0  # llama.cpp copies between per-sequence streams only whole (it aborts on a prefix)
        best: Session | None = None
        best_n = 0
        for other in self.hot.values():
            if other is s or other.owner != s.owner:
                continue
            n = min(common_prefix(other.tokens, prompt), limit)
            if n > best_n and (self.memory.partial_ok or n == len(other.tokens)):
                best, best_n = other, n
        if best is None or best_n < self.shared_prefix_min_tokens:
            return 0
        assert best.seq is not None
        self.memory.seq_cp(best.seq, s.seq, 0, best_n)
        if not self._window_intact(s.seq, best_n):
            self.counters["window_resets"] += 1
            self.memory.seq_rm(s.seq, -1, -1)
            return 0
        s.tokens = list(prompt[:best_n])
        return best_n

    def adopt(self, s: Session, tokens: list[int], data: KVBytes) -> None:
        """Take a cache from outside (disk, an import) as the session's evicted state, to restore next."""
        self.evicted.take(s)
        s.tokens = list(tokens)
        self._keep_in_ram(s, data, pinned=True)
        self.evicted.unpin(s)
        s.phase = SessionPhase.EVICTED

    def _trim_for_restore(self, s: Session) -> None:
        """Leave :attr:`restore_margin` tokens off the end of an idle hot session about to be saved."""
        keep, window, seq = len(s.tokens) - self.restore_margin, self.memory.n_swa, s.seq
        if not (self.restore_margin and window and len(s.tokens) > window and keep > 0):
            return
        if seq is None or s.request is not None or keep - window < s.window_floor:
            return  # busy, or restored itself and not grown since: cut, it would lose its window
        if self.memory.seq_rm(seq, keep, -1) and self._window_intact(seq, keep):
            del s.tokens[keep:]
        else:  # the cells are gone but the window is not whole: rebuild rather than continue wrong
            self.counters["window_resets"] += 1
            self.memory.seq_rm(seq, -1, -1)
            s.tokens = []
            s.window_floor = 0

    def snapshot(self, s: Session, leaving: bool = False) -> tuple[list[int], KVBytes | None]:
        """A copy of a session's cache as it is now: its tokens and llama.cpp state (None: no cache).
        ``leaving``: the copy is what will continue the session (a hand-over, an export, the disk
        tier), so it leaves :attr:`restore_margin` tokens off, the live cache too."""
        if leaving and s.phase is SessionPhase.HOT:
            self._trim_for_restore(s)
        if s.phase is SessionPhase.HOT and s.tokens and s.seq is not None:
            return list(s.tokens), self.memory.save(s.seq)
        if s.phase is SessionPhase.EVICTED and s.saved is not None:
            return list(s.tokens), s.saved
        return [], None

    def fork(self, src: Session, dst: Session, n: int, protect: Iterable[Session] = ()) -> int:
        """Start ``dst`` (empty) with the first ``n`` cached tokens of ``src``; the tokens it got.

        A hot source in the shared pool is copied cell by cell (``seq_cp``: no data moves);
        otherwise its state is copied through llama.cpp's sequence serialization and cut.
        """
        n = min(n, len(src.tokens))
        if n <= 0 or not self.acquire(dst, [src, *protect]):
            return 0
        assert dst.seq is not None
        got = 0
        if src.phase is SessionPhase.HOT and src.seq is not None and self.pooled and self.memory.partial_ok:
            self.memory.seq_cp(src.seq, dst.seq, 0, n)
            if self._window_intact(dst.seq, n):
                dst.tokens = list(src.tokens[:n])
                got = n
            else:
                self.counters["window_resets"] += 1
                self.memory.seq_rm(dst.seq, -1, -1)
        else:
            tokens, data = self.snapshot(src)
            if data is not None and self.make_room(len(tokens), [src, dst, *protect]):
                if self.memory.restore(dst.seq, data):
                    dst.tokens = tokens
                    got = self.cut(dst, n)
                else:
                    self.memory.seq_rm(dst.seq, -1, -1)
        if got:
            self.counters["forks"] += 1
        return got

    def discard_saved(self, s: Session) -> None:
        """Throw away a session's KV kept in RAM (its pre-empted request was cancelled)."""
        if self.evicted.take(s) is not None:
            self._lose(s)

    # -- ending --
    def clear(self, s: Session) -> None:
        """Empty a session's cache wherever it is; it keeps its sequence if it had one."""
        self.evicted.take(s)
        if s.seq is not None:
            self.memory.seq_rm(s.seq, -1, -1)
        s.tokens = []
        s.window_floor = 0
        s.phase = SessionPhase.HOT if s.seq is not None else SessionPhase.NEW

    def forget(self, s: Session) -> None:
        """Free everything a session holds; it is closed."""
        self.evicted.take(s)
        if s.seq is not None:
            self._release_seq(s)
        s.tokens = []
        s.window_floor = 0
        s.phase = SessionPhase.CLOSED
        s.last_used = time.monotonic()
