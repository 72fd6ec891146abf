"""The scheduler: which requests run each step, with how many tokens, and how each step ends.

A step is ``schedule()`` (here: reap, admit, plan, make room) -> :meth:`Scheduler.batch`
(the plan as :class:`Piece` s) -> the runner's ``llama_decode`` (``runner.py``) -> the output
stage's outcome per sampled row (``output.py``) -> :meth:`Scheduler.update_from_output`
(here: commit the tokens, stream, end requests). The scheduler never touches the model; it
moves requests through their state machine (``requests.py``) and asks the KV manager
(``kv.py``) for sequences and cells, so all of it is tested with a fake memory.

Rules, in order of precedence:

- **Admission**: pre-empted requests come back first (oldest first); the others go cheapest
  first, by the prompt tokens their session's cache does not hold (a follow-up whose history is
  cached costs its new message, a first turn its whole prompt), aged so nothing starves: each
  second waited takes off what a second of prefill computes (:meth:`Scheduler.admission_key`).
  So a cheap follow-up does not queue behind a burst of first turns, and a first turn waits at
  most about its own prefill time longer than strict arrival order would make it. A request
  waits while its session is held by another request, while the batch is full, or while no
  sequence or room for its prompt can be had by evicting idle sessions. When nothing else
  runs it is admitted anyway (a session always fits an empty pool).
- **Batch** (:func:`plan_batch`): every decoding request gets exactly one token; prefill
  takes what is left, short prompts first and in full (a hot follow-up never waits behind a
  long cold prompt), long prompts in equal shares (a burst of new chats finishes prefilling
  together, so its sessions decode in the same wide steps instead of drifting apart: one wide
  step costs little more than a narrow one, so steps shared are throughput gained), at most
  ``prefill_chunk`` tokens per prompt and per step whenever another request shares the engine
  (so a step stays short for whoever waits on it). A prompt alone takes the whole batch.
  While some requests are decoding, the prefill of a step is paced (:class:`PrefillPacer`):
  sized from the measured cost of a step so the step lasts about ``step_target_ms``, the
  decoders' time between tokens; on a fast device that allows more than ``prefill_chunk``.
- **Memory pressure**: before a step, room for its new tokens is made by evicting idle
  sessions (LRU), then by pre-empting running requests, newest first: their KV goes to host
  RAM and they resume exactly where they were. Nobody fails because others grew.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hotloop_serve.engine.kv import KVManager, common_prefix
from hotloop_serve.engine.output import final_chunk
from hotloop_serve.engine.requests import Request, RequestKind, RequestState
from hotloop_serve.engine.session import Session, SessionPhase
from hotloop_serve.engine.stream import Chunk
from hotloop_serve.errors import Cancelled, HotloopError, NotFound, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from hotloop_serve.engine.output import Outcome
    from hotloop_serve.engine.runner import StepOutput


class Schedulable(Protocol):
    @property
    def decoding(self) -> bool: ...

    @property
    def prefill_remaining(self) -> int: ...

    @property
    def prefill_total(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Indexes into the running list with the number of tokens each contributes this step."""

    decode: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def new_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class PrefillPacer:
    """How many prompt tokens a step may add while others decode, from measured step times.

    A step's time is modelled as ``decode_s + per_token_s * prefill_tokens``: ``decode_s`` is
    learnt from steps without prefill, ``per_token_s`` from steps with enough prefill to
    dominate (both as moving averages, so a change of load or context length is followed
    within a few steps). Without estimates yet, or with ``step_target_ms`` 0, the fixed
    ``prefill_chunk`` applies. Why time, not tokens: the same token count costs a GPU a small
    fraction of what it costs two CPU cores, and what a decoding user feels is the time between
    tokens.
    """

    MIN_TOKENS = 16  # a prompt always advances, even when decoding alone fills the target
    MEASURED_FROM = 16  # prefill tokens a step needs to say something about the per-token cost
    WEIGHT = 0.25

    def __init__(self, step_target_ms: float, prefill_chunk: int, batch_tokens: int) -> None:
        self.target_s = step_target_ms / 1e3
        self.prefill_chunk = prefill_chunk
        self.batch_tokens = batch_tokens
        self.decode_s: float | None = None
        self.per_token_s: float | None = None

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        if decode_tokens and not prefill_tokens:
            self.decode_s = self._mix(self.decode_s, seconds)
        elif prefill_tokens >= self.MEASURED_FROM:
            base = self.decode_s if decode_tokens and self.decode_s is not None else 0.0
            self.per_token_s = self._mix(self.per_token_s, max(seconds - base, 0.0) / prefill_tokens)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.WEIGHT * (new - old)

    DEFAULT_PREFILL_RATE = 500.0
    """Prompt tokens a second, until measured: the order of a small model on a few CPU cores (the
    first measured step replaces it)."""

    def prefill_rate(self) -> float:
        """Prompt tokens a second, as measured (the admission order's ageing rate)."""
        if self.per_token_s is None or self.per_token_s <= 0:
            return self.DEFAULT_PREFILL_RATE
        return 1.0 / self.per_token_s

    def budget(self) -> int:
        """Prefill tokens for the next step with decoders in it."""
        if not self.target_s or self.per_token_s is None or self.decode_s is None:
            return self.prefill_chunk
        room = (self.target_s - self.decode_s) / max(self.per_token_s, 1e-6)
        return int(min(max(room, self.MIN_TOKENS), self.batch_tokens))


def plan_batch(
    active: Sequence[Schedulable],
    batch_tokens: int,
    prefill_chunk: int,
    paced_budget: int | None = None,
    fair: bool = True,
) -> BatchPlan:
    """One step's batch for ``active`` within ``batch_tokens`` tokens.

    ``paced_budget``: prefill tokens allowed beside decoders (:class:`PrefillPacer`); by
    default ``prefill_chunk``.
    ``fair=False``: shortest remaining prompt first, each taking all it needs of the budget left
    (the batch filled across prompts).
    ``fair=True`` (see :func:`_share_long_prompts`): short prompts (at most ``prefill_chunk / 2``
    tokens: follow-up messages) first and in full (the first of them even past the paced
    budget: a follow-up split over two steps costs its user a step), but while nobody decodes
    only one starts per step: follow-ups that arrive together (sessions whose replies ended in
    the same step) then decode out of phase, so each later follow-up is prefilled beside the
    others' decoding instead of all of them waiting for one long step. Long prompts share the
    rest so that prompts that arrived together finish together.
    """
    decode = tuple(i for i, r in enumerate(active) if r.decoding)
    budget = room = batch_tokens - len(decode)
    if decode:
        budget = min(budget, prefill_chunk if paced_budget is None else paced_budget)
    waiting = sorted(
        (i for i, r in enumerate(active) if not r.decoding and r.prefill_remaining > 0),
        key=lambda i: (active[i].prefill_remaining, i),
    )
    contended = len(active) > 1
    cap = prefill_chunk if contended and not decode else budget  # a long prompt never fills a step others wait on
    needs = {i: active[i].prefill_remaining for i in waiting}
    prefill: list[tuple[int, int]] = []
    if fair:
        short = [i for i in waiting if active[i].prefill_total <= prefill_chunk // 2]
        started = whole = False
        for i in short:
            n = needs[i]
            fresh = active[i].prefill_remaining == active[i].prefill_total and n > 1
            if fresh and not decode and started:
                continue  # one per step: their sessions then decode out of phase (see above)
            started = started or fresh
            if n == 1 or (n > 1 and not whole):
                take, whole = min(n, room), whole or n > 1  # a last token, and one follow-up, past the budget
            else:
                take = min(n, budget)
            if take > 0:
                prefill.append((i, take))
                budget -= take
                room -= take
        long = [i for i in waiting if i not in short]
        prefill += _share_long_prompts([(i, needs[i]) for i in long], min(budget, room), cap)
        return BatchPlan(decode, tuple(prefill))
    # Shortest remaining first, each taking all it needs of what is left (SRPT): the prompt
    # nearest to done finishes first, then decodes beside the next one's prefill; the batch is
    # filled across prompts. (Processor sharing would finish them all late for the same work.)
    for i in waiting:
        if budget <= 0:
            break
        take = min(needs[i], budget)
        prefill.append((i, take))
        budget -= take
    return BatchPlan(decode, tuple(prefill))


PREFILL_TILE = 64
"""Query rows per tile of llama.cpp's CPU flash attention (ggml-cpu's ``GGML_FA_TILE_Q``; its KV
tiles are 64 cells). A tile skips a KV tile only when it is masked for all of the tile's rows, so
a tile holding rows of two prompts computes every KV tile either of them attends to: the work of
both. Long prompts therefore get whole tiles of a step, and the runner lays a step's whole-tile
pieces out first (``runner._laid_out``); ``bench/engine.py --tiles-only`` measures the gain."""


def _share_long_prompts(needs: list[tuple[int, int]], budget: int, cap: int) -> list[tuple[int, int]]:
    """Split ``budget`` among long prompts ``(index, tokens needed)``, each at most ``cap``.

    Every prompt gets a floor of half an equal share (an early prompt keeps advancing beside a
    newcomer); the rest goes to whoever has the most left, levelling them. Prompts that arrived
    together, of different lengths, so finish in the same step: had the shortest finished
    first, its session would decode alone while the others' prompts were paced beside it, a
    few tokens a step, and the whole burst would reach its first tokens later.

    Where the budget does not finish them all, each share is then cut to whole
    :data:`PREFILL_TILE` rows and the rows cut are handed back, in whole tiles first, to the
    prompts with the most left: every piece but one is whole tiles, and no prompt finishes
    because of the cut.
    """
    take = dict(_level(needs, budget, cap))
    need = dict(needs)
    if sum(need.values()) <= budget:
        return list(take.items())
    tile = PREFILL_TILE
    cut = 0
    for i, n in take.items():
        if tile < n < need[i]:
            cut += n % tile
            take[i] = n - n % tile
    for unit in (tile, 1):
        for i, _ in sorted(needs, key=lambda item: take.get(item[0], 0) - item[1]):
            room = min(need[i] - 1, cap) - take.get(i, 0)
            give = min(room, cut) // unit * unit
            if give > 0:
                take[i] = take.get(i, 0) + give
                cut -= give
    return [(i, take[i]) for i, _ in needs if take.get(i, 0) > 0]


def _level(needs: list[tuple[int, int]], budget: int, cap: int) -> list[tuple[int, int]]:
    """The levelling of :func:`_share_long_prompts`, before its cut to whole tiles."""
    if not needs or budget <= 0:
        return []
    floor = budget // (2 * len(needs))  # 0 when the budget is smaller: then the longest go first
    take = {i: min(n, floor, cap) for i, n in needs}
    left = budget - sum(take.values())
    room = {i: min(n, cap) - take[i] for i, n in needs}
    rest = {i: n - take[i] for i, n in needs}
    while left > 0:
        open_ = [i for i in room if room[i] > 0]
        if not open_:
            break
        top = max(rest[i] for i in open_)
        leaders = [i for i in open_ if rest[i] == top]
        below = max((rest[i] for i in open_ if rest[i] < top), default=0)
        step = min(top - below, *(room[i] for i in leaders), max(1, left // len(leaders)))
        for i in leaders:
            give = min(step, left)
            take[i] += give
            room[i] -= give
            rest[i] -= give
            left -= give
            if left == 0:
                break
    return [(i, take[i]) for i, _ in needs if take[i] > 0]


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens of one sequence for one step: a decoder's next token or a slice of a prompt (what
    the runner executes; it knows sequences and positions, not requests)."""

    seq: int
    pos: int
    """Position of the first token (the sequence's cache holds ``pos`` tokens before it)."""
    tokens: Sequence[int]
    logits: bool
    """The last token's logits are wanted (a decoder that samples, a reply's last prompt token)."""
    decoding: bool = False
    """A decoder's row: with ``batch_invariant`` it runs beside the rows that make logits."""


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step as the runner gets it (``pieces``) and as the update reads it back (``requests``,
    the request of each piece, in the same order)."""

    requests: tuple[Request, ...]
    pieces: tuple[Piece, ...]
    decode_tokens: int
    prefill_tokens: int


KEPT_TURNS_MAX = 4
"""Turns in a row a session may take through the slot kept for it (``followup_slot_ms``) while
other requests wait; its next turn then queues like theirs. Keeping a slot makes a conversation's
follow-ups fast (their history is cached) at the cost of the requests waiting for a slot; an
agent loop of fifty turns must not hold one for all of them."""


class Scheduler:
    """Waiting and running requests of one engine, and the one place a request ends.

    It owns ``running``, ``waiting``, each session's ``request`` and ``pending`` count, and
    every end of a request (:meth:`finish`): ends are applied here, from what the step returned
    (:meth:`update_from_output`), never by calling back into the engine. Scheduler thread only.
    """

    def __init__(
        self,
        kv: KVManager,
        *,
        max_running: int,
        batch_tokens: int,
        prefill_chunk: int,
        session_context: int,
        step_target_ms: float = 0.0,
        fair_prefill: bool = True,
        followup_slot_s: float = 0.0,
    ) -> None:
        self.kv = kv
        self.max_running = max_running
        self.batch_tokens = batch_tokens
        self.prefill_chunk = prefill_chunk
        self.session_context = session_context
        self.pacer = PrefillPacer(step_target_ms, prefill_chunk, batch_tokens)
        self.fair_prefill = fair_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.followup_slot_s = followup_slot_s
        self.reserved: dict[Session, float] = {}
        """Sessions whose reply just ended, each holding a running slot until the time given for
        its next turn (see :meth:`_reserve`)."""
        self.steps = 0
        """Steps run to the end (a step llama.cpp refused does not count)."""
        self.usage = {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0, "restored_tokens": 0}
        """Totals over finished Generate turns (written here only; readers copy it)."""

    def add(self, req: Request) -> None:
        """Queue a submitted request; its session counts it as pending until it is admitted or ends."""
        req.session.pending += 1
        req.cost = self.estimated_cost(req)
        self.waiting.append(req)

    def estimated_cost(self, req: Request) -> int:
        """Prompt tokens to compute if ``req`` were admitted now: what neither the KV pool nor host
        RAM holds of it (a restore from RAM costs a copy, not a prefill; a file from the disk
        tier a read)."""
        s = req.session
        if req.disk is not None:
            return len(req.prompt) - common_prefix(req.disk[0], req.prompt)
        if s.phase in (SessionPhase.HOT, SessionPhase.EVICTED) and s.tokens:
            return len(req.prompt) - common_prefix(s.tokens, req.prompt)
        return len(req.prompt)

    def admission_key(self, req: Request, now: float) -> tuple[int, float, int]:
        """Pre-empted first (oldest first); then estimated cost minus what the prefill computes in
        the time the request has waited (cheapest first, aged), then arrival order."""
        if req.state is RequestState.PREEMPTED:
            return (0, 0.0, req.order)
        return (1, req.cost - (now - req.t_submit) * self.pacer.prefill_rate(), req.order)

    # -- what the engine reads --
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def waiting_count(self) -> int:
        """Requests waiting (one int read: safe from any thread, possibly a step old)."""
        return len(self.waiting)

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def preempted_count(self) -> int:
        return sum(1 for r in self.waiting if r.state is RequestState.PREEMPTED)

    def running_sessions(self) -> list[Session]:
        """Sessions of running requests: what eviction and copies must leave alone."""
        return [r.session for r in self.running]

    # -- one step: schedule --
    def schedule(self) -> BatchPlan:
        """Reap, admit, plan, and make room for the plan; :meth:`batch` then turns it into pieces."""
        self.reap()
        self.admit()
        plan = self._plan()
        while plan.new_tokens and not self._make_room(plan.new_tokens):
            if len(self.running) <= 1 or not self.preempt_newest():
                break  # one request alone always fits; let llama.cpp have the last word
            plan = self._plan()
        return plan

    def batch(self, plan: BatchPlan) -> ScheduledBatch:
        """The plan as pieces for the runner: decoders first, then prompt slices, in plan order."""
        running = self.running
        reqs: list[Request] = []
        pieces: list[Piece] = []
        for i in plan.decode:
            req = running[i]
            seq = req.session.seq
            assert seq is not None and req.last_token is not None
            wants = req.state is RequestState.DECODING
            reqs.append(req)
            pieces.append(Piece(seq, len(req.session.tokens), (req.last_token,), wants, decoding=True))
        prefill = 0
        for i, count in plan.prefill:
            req = running[i]
            seq = req.session.seq
            assert seq is not None
            start = len(req.session.tokens)
            ends = req.needs_logits and start + count == len(req.prompt)
            reqs.append(req)
            pieces.append(Piece(seq, start, req.prompt[start : start + count], ends))
            prefill += count
        return ScheduledBatch(tuple(reqs), tuple(pieces), len(plan.decode), prefill)

    def _plan(self) -> BatchPlan:
        paced = self.pacer.budget()
        if self.waiting or sum(1 for r in self.running if not r.decoding and r.prefill_remaining > 0) > 1:
            # Prompts queue: pacing would keep the decoders' steps short while every queued
            # prompt, and every session behind it, waits; throughput first (whole batches).
            paced = self.batch_tokens
        return plan_batch(self.running, self.batch_tokens, self.prefill_chunk, paced, self.fair_prefill)

    def _make_room(self, tokens: int) -> bool:
        return self.kv.make_room(tokens, self.running_sessions())

    def reap(self) -> None:
        """End cancelled requests (their session keeps its cache) and drop finished ones."""
        for req in [r for r in self.running if r.cancel_requested and r.state is not RequestState.CACHING_TAIL]:
            self.finish(req, RequestState.CANCELLED, Cancelled("request cancelled"))
        self.running = [r for r in self.running if r.live]
        for req in [r for r in self.waiting if r.cancel_requested or not r.live]:
            self.waiting.remove(req)
            if req.live:
                if req.state is RequestState.PREEMPTED:
                    self.kv.discard_saved(req.session)  # its saved KV was pinned for it alone
                self.finish(req, RequestState.CANCELLED, Cancelled("request cancelled"))

    def _reserve(self, s: Session) -> None:
        """Keep the slot of ``s``, whose reply just ended, for its next turn a little while.

        A chat client, an agent loop or a script sends the next turn as soon as the reply is
        read; through a proxy that takes tens to hundreds of milliseconds, and by then a queued
        request would have taken the slot: the follow-up, whose history is cached and costs a
        few tokens, would queue behind first turns that cost their whole prompt (issue 38, W2:
        a follow-up's median wait went from a fraction of a second in-process to ~10 s through
        HTTP). A client that took longer than ``followup_slot_s`` last time is not waited for (a
        human typing), so a slot idles at most that long, and only for clients that came back
        in time before.
        """
        if s.kept_turns >= KEPT_TURNS_MAX and self.waiting:
            s.kept_turns = 0  # others waited through its last turns: this one queues like theirs
            return
        if self.followup_slot_s > 0 and (s.return_s is None or s.return_s <= self.followup_slot_s):
            self.reserved[s] = s.finished_at + self.followup_slot_s

    def _reserved_slots(self, now: float) -> int:
        """Slots held for expected next turns (expired ones are dropped; a session whose tail
        is still running holds that request's slot, not a second one)."""
        held = self.reserved
        for s in [s for s, until in held.items() if until <= now or s.closed]:
            del held[s]
        return sum(1 for s in held if s.request is None)

    def admit(self) -> None:
        still: deque[Request] = deque()
        now = time.perf_counter()
        kept = self.reserved
        reserved = self._reserved_slots(now)
        free_kept = {s for s in kept if s.request is None}  # the slots counted in ``reserved``
        if len(self.waiting) > 1:
            # A session's next turn takes the slot kept for it first; the rest by admission key.
            self.waiting = deque(
                sorted(self.waiting, key=lambda r: (r.session not in kept, self.admission_key(r, now)))
            )
        while self.waiting:
            req = self.waiting.popleft()
            s = req.session
            if s.closed:
                self.finish(req, RequestState.FAILED, NotFound(f"session {s.id} was closed"))
                continue
            held = s.request
            if held is not None and held is not req and held.state is RequestState.CACHING_TAIL:
                # The session's next turn is here before its last reply's final token was cached:
                # that token is in the new prompt anyway, so it is prefilled with it (one token
                # more) rather than making the new turn wait a whole step behind it.
                self.finish(held, RequestState.FINISHED)
                self.running.remove(held)
            own = s in free_kept  # this turn may take the slot kept for it
            if (s.request is not None and s.request is not req) or len(
                self.running
            ) + reserved - own >= self.max_running:
                still.append(req)
                continue
            protect = self.running_sessions()
            if (
                req.state is RequestState.PREEMPTED
                and self.running
                and not self.kv.make_room(len(s.tokens) + len(self.running) + 1, [s, *protect])
            ):
                # Resumed into a pool that cannot hold it, its restore would fail and its cache
                # be rebuilt, pre-empting another: it waits until others' cells are free.
                still.append(req)
                continue
            if not self.kv.acquire(s, protect):
                still.append(req)
                continue
            if req.state is not RequestState.PREEMPTED:
                cached = common_prefix(s.tokens, req.prompt) if s.phase is SessionPhase.HOT else 0
                if self.running and not self.kv.make_room(len(req.prompt) - cached + 1, [s, *protect]):
                    still.append(req)
                    continue
            if kept.pop(s, None) is not None:
                s.kept_turns = s.kept_turns + 1 if still or self.waiting else 0  # others waited for it
                if own:
                    free_kept.discard(s)
                    reserved -= 1
            if req.state is RequestState.PREEMPTED:
                self._resume(req)
            else:
                self._start(req)
        self.waiting = still

    def _start(self, req: Request) -> None:
        """Admit a new request: restore or reuse its session's cache, cut to the common prefix."""
        s = req.session
        s.request = req
        s.pending -= 1
        req.t_admit = req.t_admit or time.perf_counter()
        protect = self.running_sessions()
        from_disk = req.disk is not None and not s.tokens and s.phase is SessionPhase.HOT
        if from_disk:
            assert req.disk is not None
            self.kv.adopt(s, *req.disk)
        req.disk = None
        restored = self.kv.restore(s, protect) if s.phase is SessionPhase.EVICTED else 0
        if from_disk and restored:
            self.kv.counters["disk_restores"] += 1
        prompt = req.prompt
        generate = req.kind is RequestKind.GENERATE
        reuse = common_prefix(s.tokens, prompt)
        if req.kind is RequestKind.WARMUP and reuse == len(prompt):
            # Warmup only adds: a cache that already starts with this prompt is left whole.
            req.usage.cached_tokens = 0 if restored else reuse
            req.usage.restored_tokens = reuse if restored else 0
            req.transition(RequestState.PREFILLING)
            self.finish(req, RequestState.FINISHED)
            return
        if generate and reuse == len(prompt):
            reuse -= 1  # the last prompt token is decoded again to get its logits
        kept = self.kv.cut(s, reuse)
        shared = self.kv.copy_prefix(s, prompt, len(prompt) - (1 if generate else 0)) if kept == 0 else 0
        if restored and kept:
            req.usage.restored_tokens = kept
        else:
            req.usage.cached_tokens = kept
        req.usage.cached_tokens += shared
        req.usage.prefilled_tokens = len(prompt) - kept - shared
        req.transition(RequestState.PREFILLING)
        self.running.append(req)
        if req.kind is RequestKind.WARMUP and req.prefill_remaining == 0:
            self.finish(req, RequestState.FINISHED)

    def _resume(self, req: Request) -> None:
        """Bring a pre-empted request back where it was (or rebuild its cache if RAM lost it)."""
        s = req.session
        tokens = list(s.tokens)
        restored = self.kv.restore(s, self.running_sessions())
        if restored:
            req.transition(RequestState.DECODING if req.last_token is not None else RequestState.PREFILLING)
        else:
            if req.last_token is not None:  # replay what it had, then decode the pending token
                req.prompt = tokens
                req.resume_token = req.last_token
                req.last_token = None
            req.transition(RequestState.PREFILLING)
        self.running.append(req)

    def preempt_newest(self) -> bool:
        """Free the cells of the most recently submitted running request; False if none can go."""
        for req in sorted(self.running, key=lambda r: r.order, reverse=True):
            if req.state is RequestState.CACHING_TAIL:
                # Its reply is complete: finish now, without caching the last token.
                self.finish(req, RequestState.FINISHED)
            else:
                self.kv.preempt(req.session)
                req.transition(RequestState.PREEMPTED)
                self._requeue(req)
            self.running.remove(req)
            return True
        return False

    def _requeue(self, req: Request) -> None:
        """Pre-empted requests go back ahead of new ones, oldest first."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].state is RequestState.PREEMPTED:
            if self.waiting[i].order > req.order:
                break
            i += 1
        self.waiting.insert(i, req)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if r.live]

    # -- one step: update --
    def update_from_output(
        self, batch: ScheduledBatch, out: StepOutput, outcomes: Sequence[Outcome | None]
    ) -> list[Session]:
        """Apply a step: its tokens are in the cache, each sampled token's outcome is streamed, and
        requests end where their reply did. ``outcomes``: per piece, the output stage's outcome of
        its row (None where it had none). Returns the sessions whose reply ended this step (the
        engine may hold the next step for their next turn)."""
        self._commit(batch, out.cached)
        if out.inconsistent:
            self._inconsistent([batch.requests[i] for i in out.inconsistent])
            return []
        if out.refused:
            self._refused()
            return []
        ended: list[Session] = []
        for req, outcome in zip(batch.requests, outcomes, strict=True):
            if outcome is not None and req.live:
                self._apply(req, outcome, ended)
        self.steps += 1
        self.pacer.observe(batch.decode_tokens, batch.prefill_tokens, out.seconds)
        self.drop_finished()
        return ended

    def _commit(self, batch: ScheduledBatch, cached: Sequence[int]) -> None:
        """The tokens the runner put in the cache are the sessions' now; end what that completes."""
        for req, piece, n in zip(batch.requests, batch.pieces, cached, strict=True):
            if not n:
                continue
            if piece.decoding:
                assert req.last_token is not None
                req.session.tokens.append(req.last_token)
                if req.state is RequestState.CACHING_TAIL:
                    self.finish(req, RequestState.FINISHED)
                continue
            req.session.tokens.extend(piece.tokens[:n])
            if req.prefill_remaining == 0:
                if req.kind is RequestKind.WARMUP:
                    self.finish(req, RequestState.FINISHED)
                elif req.resume_token is not None:  # a pre-empted reply rebuilt its cache: go on decoding
                    req.last_token, req.resume_token = req.resume_token, None
                    req.transition(RequestState.DECODING)

    def _apply(self, req: Request, o: Outcome, ended: list[Session]) -> None:
        """Stream a sampled token's text; end the reply on its own end or on a limit, else decode it next."""
        if o.text:
            req.stream.put(Chunk(o.text, logprobs=o.logprobs))
        if o.finish == "eos":
            self._end_reply(req, "eos", ended, cache_token=o.token)
        elif o.finish is not None:
            self._end_reply(req, o.finish, ended)
        elif req.generated >= req.settings.sample_len:
            self._end_reply(req, "length", ended, cache_token=o.token)
        elif len(req.session.tokens) + 1 >= self.session_context:
            self._end_reply(req, "context", ended)
        else:
            req.last_token = o.token
            if req.state is RequestState.PREFILLING:
                req.transition(RequestState.DECODING)

    def _end_reply(self, req: Request, reason: str, ended: list[Session], cache_token: int | None = None) -> None:
        """Send the final chunk now; keep the request one more step to cache its last token if it fits."""
        s = req.session
        if not req.cancel_requested:  # before the chunk: the client's next request may follow at once
            s.finished_at = time.perf_counter()
            ended.append(s)
            self._reserve(s)
        req.stream.put(final_chunk(req, reason))
        fits = len(s.tokens) + 1 < self.session_context
        if cache_token is not None and fits and not req.cancel_requested:
            req.last_token = cache_token
            req.transition(RequestState.CACHING_TAIL)
        else:
            self.finish(req, RequestState.FINISHED)

    def _inconsistent(self, requests: Sequence[Request]) -> None:
        """llama.cpp refused a step because these requests' sessions' caches do not continue where
        their tokens say (a bug, or a state that slipped past the import checks): drop those
        caches and fail those requests with a retryable status; the rest run next step. The
        session is rebuilt from its history on the retry; no other session is affected."""
        for req in requests:
            if req.live:
                self.finish(
                    req,
                    RequestState.FAILED,
                    Unavailable(
                        "this session's cache on the replica was inconsistent and has been dropped; "
                        "retry the turn (its history rebuilds the cache)"
                    ),
                )
            self.kv.clear(req.session)
        self.drop_finished()

    def _refused(self) -> None:
        """llama.cpp had no room for the step: pre-empt the newest request and retry next step, or,
        alone, fail what runs (its cache cannot grow)."""
        if len(self.running) > 1 and self.preempt_newest():
            return
        for req in list(self.running):
            error = ResourceExhausted(
                f"the replica's KV cache is full (engine.context_tokens={self.kv.capacity}); "
                "retry, or raise context_tokens"
            )
            self.finish(req, RequestState.FAILED, error)
            self.kv.clear(req.session)
        self.drop_finished()

    # -- ends --
    def finish(self, req: Request, state: RequestState, error: HotloopError | None = None) -> None:
        """The one way a request ends: its state, its session's counts, its stream's last item.

        A reply's final chunk was sent when the reply ended (``_end_reply``); a warmup's is sent here.
        """
        if req.state is RequestState.WAITING:
            req.session.pending -= 1
        req.transition(state)
        if error is not None:
            req.stream.put(error)
        elif state is RequestState.FINISHED:
            if req.kind is RequestKind.WARMUP:
                req.stream.put(final_chunk(req, "eos"))
            else:
                u = self.usage
                u["turns"] += 1
                u["prompt_tokens"] += req.usage.prompt_tokens
                u["cached_tokens"] += req.usage.cached_tokens
                u["restored_tokens"] += req.usage.restored_tokens

    def end_session_request(self, s: Session, why: str) -> None:
        """End whatever request holds ``s`` (its session is cleared or closed); a finished reply's
        tail is not cached. A request still waiting for a closed session fails at admission."""
        req = s.request
        if req is None or not req.live:
            return
        if req.state is RequestState.CACHING_TAIL:
            self.finish(req, RequestState.FINISHED)
        else:
            if req.state is RequestState.PREEMPTED:
                self.kv.discard_saved(s)
            self.finish(req, RequestState.CANCELLED, Cancelled(f"request cancelled: the session was {why}"))
        self.drop_finished()
        if req in self.waiting:
            self.waiting.remove(req)

    def fail_all(self, error: HotloopError) -> None:
        """End every request with ``error`` (the engine stopped or failed)."""
        for req in [*self.running, *self.waiting]:
            if req.live:
                self.finish(req, RequestState.FAILED, error)
        self.running.clear()
        self.waiting.clear()
