"""The KV manager and scheduler against a fake llama.cpp memory: every rule, no model."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

import pytest

from hotloop_serve.engine.kv import KVManager, common_prefix
from hotloop_serve.engine.output import Outcome
from hotloop_serve.engine.requests import Request, RequestKind, RequestState
from hotloop_serve.engine.runner import StepOutput
from hotloop_serve.engine.scheduler import KEPT_TURNS_MAX, Scheduler
from hotloop_serve.engine.session import KVBytes, Session, SessionPhase
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import ResourceExhausted


@dataclass
class FakeMemory:
    """Positions per sequence; a sliding window that can lose cells below ``lost_below``."""

    n_swa: int = 0
    partial_ok: bool = True
    cells: dict[int, set[int]] = field(default_factory=dict)
    lost_below: dict[int, int] = field(default_factory=dict)
    restore_ok: bool = True

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        if p0 > 0 and not self.partial_ok:
            return False
        have = self.cells.setdefault(seq, set())
        hi = p1 if p1 >= 0 else 1 << 30
        lo = max(p0, 0)
        self.cells[seq] = {p for p in have if not lo <= p < hi}
        if p0 <= 0:
            self.lost_below.pop(seq, None)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        lost = self.lost_below.get(src, 0)
        self.cells.setdefault(dst, set()).update(p for p in self.cells.get(src, set()) if p0 <= p < p1 and p >= lost)

    def window_cells(self, seq: int) -> int:
        have = self.cells.get(seq, set())
        if not have:
            return 0
        top = max(have)
        return sum(1 for p in have if top - p < self.n_swa and p >= self.lost_below.get(seq, 0))

    def save(self, seq: int) -> KVBytes | None:
        n = len(self.cells.get(seq, ()))
        return (ctypes.c_uint8 * max(n, 1))()

    def restore(self, seq: int, data: KVBytes) -> bool:
        if not self.restore_ok:
            self.cells[seq] = {0}  # a half-written restore
            return False
        self.cells[seq] = set(range(len(data)))
        if self.n_swa:  # llama.cpp restores window cells only within the window of the last position
            self.lost_below[seq] = len(data) - self.n_swa
        return True

    def fill(self, s: Session, n: int) -> None:
        assert s.seq is not None
        self.cells.setdefault(s.seq, set()).update(range(len(s.tokens), len(s.tokens) + n))
        s.tokens.extend(range(len(s.tokens), len(s.tokens) + n))


def manager(mem: FakeMemory, seqs: int = 2, capacity: int = 100, ram: int = 10_000, margin: int = 0) -> KVManager:
    return KVManager(
        mem, sequences=seqs, capacity_tokens=capacity, evicted_bytes=ram, shared_prefix_min_tokens=4,
        restore_margin=margin,
    )  # fmt: skip


def session(name: str, owner: str = "p") -> Session:
    return Session(name, owner, SamplingSettings())


def test_lru_idle_session_is_evicted_to_ram_and_restored() -> None:
    mem = FakeMemory()
    kv = manager(mem)
    a, b, c = session("a"), session("b"), session("c")
    for s in (a, b):
        assert kv.acquire(s)
        mem.fill(s, 10)
    a.last_used, b.last_used = 1.0, 2.0
    assert kv.acquire(c)  # no free sequence: "a" (least recently used) goes to RAM
    assert a.phase is SessionPhase.EVICTED and a.seq is None and kv.evicted.bytes == 10
    mem.fill(c, 10)
    kv.evict(b)
    assert kv.acquire(a) and kv.restore(a) == 10 and a.phase is SessionPhase.HOT


def windowed_session(margin: int) -> tuple[FakeMemory, KVManager, Session]:
    """A hot 20-token session of a model with an 8-position sliding window."""
    mem = FakeMemory(n_swa=8)
    kv = manager(mem, margin=margin)
    a = session("a")
    kv.acquire(a)
    mem.fill(a, 20)
    return mem, kv, a


@pytest.mark.parametrize("margin", [0, 4])
def test_a_restored_sliding_window_cache_serves_a_follow_up_that_cuts_its_tail(margin: int) -> None:
    # A follow-up re-renders the reply's last tokens differently: it shares all but the last
    # 2 cached tokens. Restored whole, the window lacks the cells that cut needs (rebuilt);
    # saved without a margin of 4, the restored cache is continued.
    _, kv, a = windowed_session(margin)
    prompt = [*a.tokens[:18], 99, 98, 97]
    kv.evict(a)
    assert kv.acquire(a) and kv.restore(a) == 20 - margin
    kept = kv.cut(a, common_prefix(a.tokens, prompt))
    assert kept == (16 if margin else 0)
    assert kv.counters["window_resets"] == (0 if margin else 1)


def test_a_restored_cache_is_not_trimmed_again_below_its_window() -> None:
    # Restored, the cache holds window cells only for its last 8 positions: trimming it again
    # would lose its window (and with it the whole cache). It is saved whole until it grew.
    mem, kv, a = windowed_session(4)
    kv.evict(a)
    assert kv.acquire(a) and kv.restore(a) == 16 and a.window_floor == 8
    kv.evict(a)
    assert kv.acquire(a) and kv.restore(a) == 16 and kv.counters["window_resets"] == 0
    mem.fill(a, 10)  # two turns later: 26 tokens, the last 18 with their window
    kv.evict(a)
    assert kv.acquire(a) and kv.restore(a) == 22


def test_a_pre_empted_session_is_saved_whole() -> None:
    _, kv, a = windowed_session(4)
    kv.preempt(a)
    assert kv.acquire(a) and kv.restore(a) == 20 and len(a.tokens) == 20


def test_past_the_ram_budget_the_oldest_evicted_session_is_dropped() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=3, ram=15)
    a, b = session("a"), session("b")
    for s in (a, b):
        kv.acquire(s)
        mem.fill(s, 10)
    kv.evict(a)
    kv.evict(b)
    assert a.phase is SessionPhase.DROPPED and a.tokens == [] and b.phase is SessionPhase.EVICTED


def test_make_room_evicts_idle_but_never_protected_sessions() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=3, capacity=30)
    a, b, c = session("a"), session("b"), session("c")
    for s in (a, b, c):
        kv.acquire(s)
        mem.fill(s, 10)
    assert kv.make_room(10, protect=[a])
    assert a.phase is SessionPhase.HOT and SessionPhase.EVICTED in (b.phase, c.phase)
    assert not kv.make_room(100, protect=[a])


def test_a_failed_restore_leaves_no_partial_state() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=1)
    a, b = session("a"), session("b")
    kv.acquire(a)
    mem.fill(a, 10)
    kv.acquire(b)  # evicts a
    kv.forget(b)
    mem.restore_ok = False
    kv.acquire(a)
    assert kv.restore(a) == 0
    assert a.tokens == [] and mem.cells[a.seq] == set() and kv.counters["restore_failures"] == 1  # type: ignore[index]


def test_cut_rebuilds_when_sliding_window_cells_are_gone() -> None:
    mem = FakeMemory(n_swa=8)
    kv = manager(mem)
    a = session("a")
    kv.acquire(a)
    mem.fill(a, 40)
    assert kv.cut(a, 30) == 30  # the window before position 30 is intact
    mem.lost_below[a.seq] = 20  # type: ignore[index]  # llama.cpp reused cells of positions < 20
    assert kv.cut(a, 25) == 0 and a.tokens == [] and kv.counters["window_resets"] == 1


def test_prefix_copy_is_per_owner_and_checks_the_window() -> None:
    mem = FakeMemory(n_swa=8)
    kv = manager(mem, seqs=4)
    a, mine, theirs = session("a"), session("m"), session("t", owner="q")
    kv.acquire(a)
    mem.fill(a, 40)
    for s in (mine, theirs):
        kv.acquire(s)
    prompt = [*range(30), 999]
    assert kv.copy_prefix(theirs, prompt, 30) == 0
    assert kv.copy_prefix(mine, prompt, 30) == 30 and mine.tokens == list(range(30))
    kv.clear(mine)
    mem.lost_below[a.seq] = 25  # type: ignore[index]
    assert kv.copy_prefix(mine, prompt, 30) == 0 and mine.tokens == []


def test_recurrent_models_only_reuse_whole_caches() -> None:
    mem = FakeMemory(partial_ok=False)
    kv = manager(mem, seqs=3)
    a, b = session("a"), session("b")
    kv.acquire(a)
    mem.fill(a, 20)
    kv.acquire(b)
    assert kv.copy_prefix(b, [*range(10), 7], 10) == 0  # a partial copy is refused
    assert kv.cut(a, 10) == 0 and a.tokens == []


# -- scheduler


def make_scheduler(kv: KVManager, max_running: int = 4, session_context: int = 1024) -> Scheduler:
    return Scheduler(kv, max_running=max_running, batch_tokens=64, prefill_chunk=16, session_context=session_context)


def submit(sched: Scheduler, s: Session, prompt_len: int, order: int, sample_len: int = 16) -> Request:
    settings = SamplingSettings(sample_len=sample_len)
    req = Request(RequestKind.GENERATE, s, list(range(prompt_len)), settings, lambda: None, order=order)
    sched.add(req)
    return req


def run_step(
    sched: Scheduler, mem: FakeMemory, sampled: dict[Request, Outcome], refused: bool = False
) -> list[Session]:
    """One step as the engine runs it, with a fake runner: every piece enters the (fake) cache
    unless ``refused``, and the requests in ``sampled`` get these outcomes for their rows."""
    batch = sched.batch(sched.schedule())
    for piece in batch.pieces if not refused else ():
        mem.cells.setdefault(piece.seq, set()).update(range(piece.pos, piece.pos + len(piece.tokens)))
    n = len(batch.pieces)
    cached = (0,) * n if refused else tuple(len(p.tokens) for p in batch.pieces)
    out = StepOutput(0.01, (None,) * n, cached, refused=refused)
    outcomes = [
        sampled.get(req) if piece.logits else None for req, piece in zip(batch.requests, batch.pieces, strict=True)
    ]
    return sched.update_from_output(batch, out, outcomes)


def test_under_pressure_the_newest_running_request_is_preempted_and_resumes_first() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=4, capacity=60)
    sched = make_scheduler(kv)
    a, b = session("a"), session("b")
    ra, rb = submit(sched, a, 20, 0), submit(sched, b, 20, 1)
    sched.schedule()
    for r in (ra, rb):  # both prefilled, both decoding
        mem.fill(r.session, 20)
        r.last_token = 1
        r.transition(RequestState.DECODING)
    mem.fill(a, 19)  # the replies grew: 59 of 60 cells used, the next step needs 2
    plan = sched.schedule()
    assert rb.state is RequestState.PREEMPTED and b.phase is SessionPhase.EVICTED
    assert plan.decode == (0,) and sched.running == [ra]
    newcomer = submit(sched, session("c"), 5, 2)
    assert list(sched.waiting) == [rb, newcomer]  # the pre-empted one resumes first
    kv.forget(a)
    ra.transition(RequestState.FINISHED)
    sched.schedule()
    assert rb.state is RequestState.DECODING and b.phase is SessionPhase.HOT and len(b.tokens) == 20


def test_a_request_waits_while_another_holds_its_session() -> None:
    kv = manager(FakeMemory(), seqs=4)
    sched = make_scheduler(kv)
    a = session("a")
    first, second = submit(sched, a, 10, 0), submit(sched, a, 12, 1)
    sched.schedule()
    assert first.state is RequestState.PREFILLING and second.state is RequestState.WAITING
    first.cancel_requested = True
    sched.schedule()
    assert first.state is RequestState.CANCELLED and second.state is RequestState.PREFILLING
    assert a.pending == 0 and a.request is second


def test_cancelling_a_preempted_request_frees_its_ram() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=2, capacity=40)
    sched = make_scheduler(kv)
    a, b = session("a"), session("b")
    ra, rb = submit(sched, a, 10, 0), submit(sched, b, 10, 1)
    sched.schedule()
    mem.fill(a, 10)
    mem.fill(b, 10)
    assert sched.preempt_newest() and kv.evicted.bytes == 10
    rb.cancel_requested = True
    sched.schedule()
    assert rb.state is RequestState.CANCELLED and kv.evicted.bytes == 0 and b.phase is SessionPhase.DROPPED
    assert ra.sampler is None and rb.sampler is None


def test_a_step_commits_its_tokens_streams_the_outcome_and_ends_the_reply_in_the_scheduler() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=2)
    sched = make_scheduler(kv)
    a = session("a")
    req = submit(sched, a, 10, 0, sample_len=2)
    assert a.pending == 1
    req.generated = 1  # the output stage counts what it samples
    assert run_step(sched, mem, {req: Outcome(5, "hi", None)}) == []
    assert a.pending == 0 and len(a.tokens) == 10 and req.state is RequestState.DECODING and req.last_token == 5
    req.generated = 2
    ended = run_step(sched, mem, {req: Outcome(6, "!", None)})  # sample_len reached: its last token is cached next
    assert ended == [a] and req.state is RequestState.CACHING_TAIL and a.finished_at > 0
    run_step(sched, mem, {})
    assert req.state is RequestState.FINISHED and a.tokens[-1] == 6 and sched.running == []
    chunks = [c for c in req.stream]
    assert [c.text for c in chunks] == ["hi!"] and chunks[-1].finish_reason == "length"
    assert sched.usage["turns"] == 1 and sched.usage["prompt_tokens"] == 10


def test_a_refused_step_preempts_the_newest_then_fails_a_request_alone() -> None:
    mem = FakeMemory()
    kv = manager(mem, seqs=2)
    sched = make_scheduler(kv)
    a, b = session("a"), session("b")
    ra, rb = submit(sched, a, 10, 0), submit(sched, b, 10, 1)
    run_step(sched, mem, {}, refused=True)
    assert rb.state is RequestState.PREEMPTED and ra.state is RequestState.PREFILLING and a.tokens == []
    assert sched.steps == 0 and sched.running == [ra]
    rb.cancel_requested = True  # b gives up; a alone is refused again
    run_step(sched, mem, {}, refused=True)
    assert ra.state is RequestState.FAILED and sched.running == []
    with pytest.raises(ResourceExhausted):
        ra.stream.result()


def test_a_cached_follow_up_is_admitted_before_cold_first_turns_that_came_first() -> None:
    """With every slot busy, a follow-up whose history is cached (it costs its new message) goes
    ahead of first turns queued before it (each costs its whole prompt): FIFO made it wait for all
    of them (issue 38, W2: a ~0.3 s follow-up waited 31 s at the median)."""
    mem = FakeMemory()
    kv = manager(mem, seqs=8, capacity=10_000)
    sched = make_scheduler(kv, max_running=1)
    old = session("old")
    running = submit(sched, session("busy"), 10, 0)
    sched.schedule()
    assert sched.running == [running]
    # "old" was served before: its first 300 tokens are cached (hot, idle).
    assert kv.acquire(old)
    mem.fill(old, 300)
    cold = [submit(sched, session(f"new{i}"), 600, 1 + i) for i in range(3)]
    follow = submit(sched, old, 310, 10)
    assert follow.cost == 10 and all(r.cost == 600 for r in cold)
    running.cancel_requested = True
    sched.schedule()
    assert sched.running == [follow]
    assert [r for r in sched.waiting] == cold  # the cold ones keep their arrival order


def test_ageing_lets_a_long_waiting_first_turn_go_before_newer_cheap_ones() -> None:
    kv = manager(FakeMemory(), seqs=8, capacity=10_000)
    sched = make_scheduler(kv, max_running=1)
    busy = submit(sched, session("busy"), 10, 0)
    sched.schedule()
    cold = submit(sched, session("cold"), 600, 1)
    cold.t_submit -= 600 / sched.pacer.prefill_rate() + 1.0  # it waited longer than its own prefill
    cheap = submit(sched, session("cheap"), 20, 2)
    busy.cancel_requested = True
    sched.schedule()
    assert sched.running == [cold] and list(sched.waiting) == [cheap]


def one_token_reply(followup_slot_s: float = 0.5) -> tuple[FakeMemory, Scheduler, Session, Request]:
    """A one-slot scheduler with slots kept for next turns, and session "a"'s one-token reply running."""
    mem = FakeMemory()
    sched = make_scheduler(manager(mem, seqs=8, capacity=10_000), max_running=1)
    sched.followup_slot_s = followup_slot_s
    a = session("a")
    first = submit(sched, a, 10, 0, sample_len=1)
    first.generated = 1
    return mem, sched, a, first


def test_a_finished_reply_keeps_its_slot_for_the_sessions_next_turn_a_while() -> None:
    """Through a proxy a client's next turn lands a while after its reply; without the kept slot a
    queued first turn took it and the cached follow-up waited behind every first turn (issue 38)."""
    mem, sched, a, first = one_token_reply()
    assert run_step(sched, mem, {first: Outcome(5, "x", None)}) == [a]  # reply over; its tail caches next
    cold = submit(sched, session("cold"), 600, 1)
    cold.t_submit -= 60.0  # it waited long: by cost and age it would go first
    run_step(sched, mem, {})  # the tail is cached; the slot stays kept for "a"
    assert first.state is RequestState.FINISHED and sched.running == [] and list(sched.waiting) == [cold]
    follow = submit(sched, a, 12, 2)
    sched.schedule()
    assert sched.running == [follow] and list(sched.waiting) == [cold] and a not in sched.reserved


def test_a_kept_slot_is_released_when_the_next_turn_does_not_come_in_time() -> None:
    mem, sched, a, first = one_token_reply()
    run_step(sched, mem, {first: Outcome(5, "x", None)})
    cold = submit(sched, session("cold"), 600, 1)
    run_step(sched, mem, {})
    assert sched.running == []
    sched.reserved[a] = time.perf_counter() - 0.01  # its time ran out
    sched.schedule()
    assert sched.running == [cold] and sched.reserved == {}
    a.return_s = 2.0  # a client that took 2 s last time is not waited for
    follow = submit(sched, a, 12, 2)
    cold.cancel_requested = True
    follow.generated = 1
    sched.schedule()
    assert sched.running == [follow]
    run_step(sched, mem, {follow: Outcome(5, "y", None)})
    assert a not in sched.reserved


def test_a_session_keeps_its_slot_for_a_bounded_number_of_turns_while_others_wait() -> None:
    """An agent loop coming back at once must not hold a slot for all its turns while a first
    turn waits: after KEPT_TURNS_MAX kept turns its next one queues like the others."""
    mem = FakeMemory()
    kv = manager(mem, seqs=8, capacity=100_000)
    sched = make_scheduler(kv, max_running=1, session_context=100_000)
    sched.followup_slot_s = 0.5
    agent = session("agent")
    req = submit(sched, agent, 10, 0, sample_len=1)
    cold = submit(sched, session("cold"), 600, 1)
    for turn in range(1, KEPT_TURNS_MAX + 2):
        req.generated = 1
        run_step(sched, mem, {req: Outcome(5, "x", None)})  # its reply ends
        run_step(sched, mem, {})  # its tail is cached
        if turn > KEPT_TURNS_MAX:
            break
        assert sched.running == [] and list(sched.waiting) == [cold]  # the slot waits for the agent
        req = submit(sched, agent, len(agent.tokens) + 5, 1 + turn, sample_len=1)
        sched.schedule()
        assert sched.running == [req], turn
    assert agent not in sched.reserved
    sched.schedule()
    assert sched.running == [cold]
