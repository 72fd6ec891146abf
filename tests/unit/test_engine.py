"""The engine on a tiny generated GGUF: reuse, batching, eviction, cancellation, bounds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from llama_split import micro_batches

from hotloop_serve.engine import engine as engine_module
from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.runner import ModelRunner, Rows, StepOutput
from hotloop_serve.engine.scheduler import Piece
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import Cancelled, InvalidArgument, NotFound, OutOfRange, ResourceExhausted

GREEDY = SamplingSettings(temperature=0, sample_len=24, repeat_penalty=1.0)


StepHook = Callable[[Sequence[Piece]], None]
DecodeHook = Callable[[Sequence[Piece], Rows], None]


class RecordingRunner(ModelRunner):
    """The real runner, watched: ``on_step`` sees each step's pieces before they run (and may
    slow it: a slow device), ``on_decode`` each ``llama_decode``'s rows (a shadow row as its
    piece's row one token past its end: ``(i, len(tokens), 1)``, right after the piece's row)."""

    def __init__(
        self, model: Model, opts: EngineOptions, on_step: StepHook | None, on_decode: DecodeHook | None
    ) -> None:
        super().__init__(model, opts)
        self.on_step = on_step
        self.on_decode = on_decode

    def execute(self, pieces: Sequence[Piece]) -> StepOutput:
        if self.on_step is not None:
            self.on_step(pieces)
        return super().execute(pieces)

    def decode(self, pieces: Sequence[Piece], rows: Rows, shadows: Sequence[int] = ()) -> float | None:
        if self.on_decode is not None:
            laid: Rows = []
            for i, start, n in rows:
                laid += [(i, start, n)] + ([(i, len(pieces[i].tokens), 1)] if i in shadows else [])
            self.on_decode(pieces, laid)
        return super().decode(pieces, rows, shadows)


def recording(
    on_step: StepHook | None = None, on_decode: DecodeHook | None = None
) -> Callable[[Model, EngineOptions], ModelRunner]:
    """An ``Engine(runner=...)`` factory of :class:`RecordingRunner` with these hooks."""
    return lambda model, opts: RecordingRunner(model, opts, on_step, on_decode)


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4)) as e:
        yield e


def history(n: int = 0) -> list[M]:
    return [M("system", "You are a test."), M("user", f"Question number {n}: what is going on here?")]


def settle(engine: Engine) -> None:
    """Wait for the scheduler to go idle (a finished reply's last token is cached one step later)."""
    for _ in range(200):
        if engine.stats().active_requests == 0:
            return
        time.sleep(0.005)
    raise AssertionError(f"engine did not settle: {engine.stats()}")


def test_same_history_again_reuses_all_but_the_last_prompt_token(engine: Engine) -> None:
    first = engine.generate("s", "a", history(), GREEDY).result()
    n = first.usage.prompt_tokens  # type: ignore[union-attr]
    assert first.usage.cached_tokens == 0 and first.usage.prefilled_tokens == n  # type: ignore[union-attr]
    settle(engine)
    again = engine.generate("s", "a", history(), GREEDY).result()
    assert again.usage.cached_tokens == n - 1  # type: ignore[union-attr]
    assert again.usage.prefilled_tokens == 1  # type: ignore[union-attr]
    assert again.text == first.text


def test_stats_count_prompt_tokens_and_their_cache_hits(engine: Engine) -> None:
    """`hotloop-serve status` computes hit rates from these counters (cached / prompt tokens)."""
    first = engine.generate("s", "a", history(), GREEDY).result()
    settle(engine)
    again = engine.generate("s", "a", history(), GREEDY).result()
    settle(engine)
    assert first.usage is not None and again.usage is not None
    stats = engine.stats()
    assert stats.turns == 2
    assert stats.prompt_tokens == first.usage.prompt_tokens + again.usage.prompt_tokens
    assert stats.cached_tokens == again.usage.cached_tokens > 0 and stats.restored_tokens == 0


def test_second_turn_reuses_the_first_turn(engine: Engine) -> None:
    turn1 = history()
    r1 = engine.generate("s", "a", turn1, GREEDY).result()
    settle(engine)
    assert engine.session_info("s", "a").context_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens  # type: ignore[union-attr]
    turn2 = [*turn1, M("assistant", "ok"), M("user", "next")]
    r2 = engine.generate("s", "a", turn2, GREEDY).result()
    u = r2.usage
    assert u is not None and r1.usage is not None
    assert u.cached_tokens >= r1.usage.prompt_tokens
    assert u.cached_tokens + u.prefilled_tokens == u.prompt_tokens


def test_sample_len_caps_generation(engine: Engine) -> None:
    r = engine.generate("s", "a", history(), GREEDY.merged(sample_len=7)).result()
    assert r.usage is not None and r.usage.completion_tokens <= 7
    if r.finish_reason == "length":
        assert r.usage.completion_tokens == 7


def test_batched_sessions_match_each_alone(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4)
    with Engine(str(tiny_model), opts) as alone:
        expected = [alone.generate(f"s{i}", "a", history(i), GREEDY).result().text for i in range(4)]
    with Engine(str(tiny_model), opts) as together:
        streams = [together.generate(f"s{i}", "a", history(i), GREEDY) for i in range(4)]
        got = [s.result().text for s in streams]
        assert together.stats().steps < 4 * (GREEDY.sample_len + 1)  # they really shared steps
    assert got == expected


@pytest.mark.parametrize("invariant", [True, False])
def test_rows_that_make_logits_run_apart_from_prompt_rows_when_batch_invariant(
    tiny_model: Path, invariant: bool
) -> None:
    """Each llama_decode's (step, decoder rows, prompt rows, logits wanted) while a prompt joins a decoder."""
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4, batch_invariant=invariant)
    calls: list[tuple[int, int, int, int]] = []
    steps = [0]

    def logged(pieces: Sequence[Piece], rows: Rows) -> None:
        decoders = sum(1 for i, _, _ in rows if pieces[i].decoding)
        prompt = sum(n for i, _, n in rows if not pieces[i].decoding)
        wants = sum(1 for i, start, n in rows if pieces[i].logits and start + n == len(pieces[i].tokens))
        calls.append((steps[0], decoders, prompt, wants))

    def count(pieces: Sequence[Piece]) -> None:
        steps[0] += 1

    with Engine(str(tiny_model), opts, runner=recording(on_step=count, on_decode=logged)) as e:
        busy = e.generate("busy", "p", history(1), SamplingSettings(temperature=0, sample_len=400))
        while steps[0] < 4:
            time.sleep(0.005)
        reply = e.generate("quick", "p", history(), GREEDY.merged(sample_len=1)).result()
        busy.cancel()
    assert reply.usage is not None and reply.usage.completion_tokens == 1
    mixed = [c for c in calls if c[1] and c[2] > 1]
    if not invariant:
        assert mixed
        return
    assert not mixed  # decoders never share a llama_decode with a prompt's body
    body = next(k for k, c in enumerate(calls) if c[1] == 0 and c[2] > 1 and c[0] >= 4)
    # ...which ran first, then its last token beside the decoder, in the same step: the first
    # token still comes out of the step that prefilled the prompt.
    assert calls[body + 1][0] == calls[body][0]
    assert calls[body + 1][1:] == (1, 1, 2)


def test_deterministic_steps_decode_two_to_seven_rows_each_one_sequence_or_one_row_each(tiny_model: Path) -> None:
    """Deterministic mode: every llama_decode holds 2-7 rows, either a chunk of one sequence's
    prompt or single rows of distinct sequences (a row without a neighbouring sequence in its
    call followed by its shadow), and so does every micro-batch llama.cpp cuts it into; the
    replies are those of each session alone, with 9 sessions at once (more decoders than 7)."""
    opts = EngineOptions(
        context_tokens=4608, session_context_tokens=512, hot_sessions=9, kv_layout="per_session", deterministic=True
    )
    calls: list[list[tuple[int, int, int]]] = []
    seqs: list[list[int]] = []

    def logged(pieces: Sequence[Piece], rows: Rows) -> None:
        calls.append(list(rows))
        seqs.append([pieces[i].seq for i, _, n in rows for _ in range(n)])

    follow_up = [*history(4), M("assistant", "ok"), M("user", "and then?")]
    with Engine(str(tiny_model), opts) as alone:
        expected = [alone.generate(f"a{i}", "a", history(i), GREEDY).result().text for i in range(9)]
        expected.append(alone.generate("a4", "a", follow_up, GREEDY).result().text)
    with Engine(str(tiny_model), opts, runner=recording(on_decode=logged)) as e:
        streams = [e.generate(f"s{i}", "a", history(i), GREEDY) for i in range(9)]
        got = [s.result().text for s in streams]
        settle(e)
        got.append(e.generate("s4", "a", follow_up, GREEDY).result().text)  # decodes alone
    assert got == expected
    shadowed = 0
    for rows, ids in zip(calls, seqs, strict=True):
        assert 2 <= len(ids) <= 7, (rows, ids)
        for mb in micro_batches(ids):
            assert 2 <= len(mb) <= 7, (rows, ids)
        if len(rows) > 1:  # single rows, each of its own sequence, some with their shadow
            assert all(n == 1 for _, _, n in rows)
            pieces = [i for i, _, _ in rows]
            shadowed += len(pieces) - len(set(pieces))
    assert shadowed  # a lone row, with its shadow


def test_evicted_session_restores_and_continues_identically(tiny_model: Path) -> None:
    turn2 = [*history(), M("assistant", "ok"), M("user", "and then?")]
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=2)) as e:
        e.generate("a", "p", history(), GREEDY).result()
        settle(e)
        reference = e.generate("a", "p", turn2, GREEDY).result()
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=1)) as e:
        e.generate("a", "p", history(), GREEDY).result()
        settle(e)
        e.generate("b", "p", history(9), GREEDY).result()  # takes the only sequence: "a" is evicted
        settle(e)
        assert e.session_info("a", "p").state == "evicted"
        restored = e.generate("a", "p", turn2, GREEDY).result()
    assert restored.usage is not None and reference.usage is not None
    assert restored.usage.restored_tokens == reference.usage.cached_tokens > 0
    assert restored.text == reference.text


def test_evicted_past_budget_is_dropped_and_rebuilt(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=1, evicted_bytes=0)
    with Engine(str(tiny_model), opts) as e:
        first = e.generate("a", "p", history(), GREEDY).result()
        settle(e)
        e.generate("b", "p", history(9), GREEDY).result()
        settle(e)
        assert e.session_info("a", "p").state in ("dropped", "new")
        again = e.generate("a", "p", history(), GREEDY).result()
    assert again.usage is not None and again.usage.cached_tokens == again.usage.restored_tokens == 0
    assert again.text == first.text


def test_cancel_frees_the_sequence_and_keeps_the_cache_consistent(engine: Engine) -> None:
    stream = engine.generate("s", "a", history(), GREEDY.merged(sample_len=500))
    it = iter(stream)
    next(it)
    stream.cancel()
    settle(engine)
    assert engine.stats().active_requests == 0
    held = engine.session_info("s", "a").context_tokens
    assert held > 0
    r = engine.generate("s", "a", history(), GREEDY).result()
    assert r.usage is not None and r.usage.cached_tokens > 0


def test_concurrent_callers_from_many_threads(engine: Engine) -> None:
    expected = {}
    for i in range(6):
        expected[i] = engine.generate(f"ref{i}", "a", history(i), GREEDY).result().text
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = engine.generate(f"t{i}", "a", history(i), GREEDY).result().text
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert results == expected


def test_shared_prefix_is_copied_within_one_owner_only(engine: Engine) -> None:
    system = M("system", "A long shared system prompt. " * 8)
    engine.generate("first", "alice", [system, M("user", "one")], GREEDY).result()
    settle(engine)
    mine = engine.generate("second", "alice", [system, M("user", "two")], GREEDY).result()
    theirs = engine.generate("third", "bob", [system, M("user", "two")], GREEDY).result()
    assert mine.usage is not None and theirs.usage is not None
    assert mine.usage.cached_tokens >= 200
    assert theirs.usage.cached_tokens == 0
    assert mine.text == theirs.text


def test_warmup_prefills_without_generating(engine: Engine) -> None:
    w = engine.warmup("s", "a", [M("system", "Be brief.")]).result()
    assert w.usage is not None and w.usage.completion_tokens == 0 and w.usage.prefilled_tokens > 0
    settle(engine)
    held = engine.session_info("s", "a").context_tokens
    assert held == w.usage.prompt_tokens
    r = engine.generate("s", "a", [M("system", "Be brief."), M("user", "hi")], GREEDY).result()
    assert r.usage is not None and r.usage.cached_tokens >= held - 1


def test_clear_cache_and_close(engine: Engine) -> None:
    engine.generate("s", "a", history(), GREEDY).result()
    settle(engine)
    assert engine.clear_cache("s", "a").context_tokens == 0
    engine.close_session("s", "a")
    with pytest.raises(NotFound):
        engine.session_info("s", "a")
    assert engine.stats().free_sequences == 4


def test_other_owner_cannot_see_a_session(engine: Engine) -> None:
    engine.create_session("s", "alice")
    for call in (engine.session_info, engine.clear_cache, engine.close_session):
        with pytest.raises(NotFound):
            call("s", "mallory")
    with pytest.raises(NotFound):
        engine.generate("s", "mallory", history(), GREEDY)


def test_history_beyond_the_window(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=1024, session_context_tokens=256, hot_sessions=2)
    with Engine(str(tiny_model), opts) as e:
        long = [M("system", "sys"), *[M("user" if i % 2 == 0 else "assistant", "x" * 60) for i in range(9)]]
        with pytest.raises(OutOfRange, match="256"):
            e.generate("s", "a", long, GREEDY)
        r = e.generate("s", "a", long, GREEDY.merged(truncate_history=True)).result()
        assert r.usage is not None and r.usage.prompt_tokens < 256


def test_bad_input_and_bounds(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=8192, session_context_tokens=8192, hot_sessions=1, max_sessions=2, max_queue=1)
    with Engine(str(tiny_model), opts) as e:
        with pytest.raises(InvalidArgument, match="empty"):
            e.generate("s", "a", [], GREEDY)
        with pytest.raises(InvalidArgument, match="role"):
            e.generate("s", "a", [M("robot", "hi")], GREEDY)
        e.create_session("s1", "a")
        e.create_session("s2", "a")
        with pytest.raises(ResourceExhausted, match="max_sessions"):
            e.create_session("s3", "a")
        busy = e.generate("s1", "a", history(), GREEDY.merged(sample_len=2000))  # long enough to still run
        while e.stats().waiting_requests or not e.stats().steps:
            time.sleep(0.001)  # until it is in the batch, out of the queue
        retry = e.generate("s1", "a", history(), GREEDY.merged(sample_len=2000))  # a retried turn supersedes it
        with pytest.raises(Cancelled):
            busy.result()
        queued = e.generate("s2", "a", history(), GREEDY)  # waits: the only sequence is busy
        with pytest.raises(ResourceExhausted, match="max_queue"):
            e.warmup("s2", "a", history())
        retry.cancel()
        assert queued.result().usage is not None


def test_stats_return_to_baseline_after_load(engine: Engine) -> None:
    base = engine.stats()
    streams = [engine.generate(f"s{i}", "a", history(i), GREEDY) for i in range(12)]
    for s in streams:
        s.result()
    for i in range(12):
        engine.close_session(f"s{i}", "a")
    settle(engine)
    after = engine.stats()
    assert (after.sessions, after.free_sequences, after.evicted_bytes) == (
        base.sessions,
        base.free_sequences,
        base.evicted_bytes,
    )


# ---------------------------------------------------------------------------------------------
# Memory pressure, restore, warmup, TTL, failure (issue 13)


def long_history(n: int, words: int) -> list[M]:
    return [M("system", "You are a test."), M("user", f"Request {n}: " + " ".join(f"w{i}" for i in range(words)))]


def test_kv_exhaustion_mid_decode_preempts_instead_of_failing(tiny_model: Path) -> None:
    """More than the pool holds once replies grow: every request completes, none fails."""
    opts = EngineOptions(context_tokens=1024, session_context_tokens=1024, hot_sessions=4, prefill_chunk=64)
    settings = GREEDY.merged(sample_len=200)
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4)) as e:
        expected = [e.generate(f"r{i}", "a", long_history(i, 30), settings).result() for i in range(4)]
    with Engine(str(tiny_model), opts) as e:
        streams = [e.generate(f"s{i}", "a", long_history(i, 30), settings) for i in range(4)]
        got = [s.result() for s in streams]
        stats = e.stats()
    assert sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in got) > 1024  # type: ignore[union-attr]
    assert stats.preemptions > 0
    assert [r.text for r in got] == [r.text for r in expected]  # resumed exactly where they were


def test_restore_into_a_full_pool_makes_room_first(tiny_model: Path) -> None:
    """An evicted session comes back while idle sessions fill the pool: it is restored, not recomputed."""
    opts = EngineOptions(context_tokens=512, session_context_tokens=512, hot_sessions=4)
    turn2 = [*long_history(0, 40), M("assistant", "ok"), M("user", "go on")]
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=512)) as ref:
        ref.generate("a", "p", long_history(0, 40), GREEDY).result()
        settle(ref)
        reference = ref.generate("a", "p", turn2, GREEDY).result()
    with Engine(str(tiny_model), opts) as e:
        e.generate("a", "p", long_history(0, 40), GREEDY).result()
        settle(e)
        e.generate("b", "p", long_history(1, 25), GREEDY).result()
        settle(e)
        e.generate("c", "p", long_history(2, 25), GREEDY).result()
        settle(e)
        e.generate("d", "p", long_history(3, 25), GREEDY).result()  # no room: "a" (LRU) goes to RAM
        settle(e)
        assert e.session_info("a", "p").state == "evicted"
        assert e.stats().free_sequences > 0  # a sequence is free, the cells are not
        restored = e.generate("a", "p", turn2, GREEDY).result()
    assert restored.usage is not None and reference.usage is not None
    assert restored.usage.restored_tokens == reference.usage.cached_tokens > 0
    assert restored.text == reference.text


def test_warmup_never_cuts_a_longer_conversation(engine: Engine) -> None:
    system = [M("system", "Be brief.")]
    engine.warmup("s", "a", system).result()
    chat = [*system, M("user", "hello there"), M("assistant", "hi"), M("user", "more")]
    engine.generate("s", "a", chat, GREEDY).result()
    settle(engine)
    held = engine.session_info("s", "a").context_tokens
    again = engine.warmup("s", "a", system).result()
    settle(engine)
    assert engine.session_info("s", "a").context_tokens == held
    assert again.usage is not None and again.usage.prefilled_tokens == 0


def test_ttl_is_enforced_while_other_sessions_keep_the_engine_busy(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=2048, hot_sessions=2, idle_ttl_s=0.3)
    with Engine(str(tiny_model), opts) as e:
        e.generate("idle", "a", history(), GREEDY).result()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and e.known("idle"):
            e.generate("busy", "a", history(1), GREEDY.merged(sample_len=200)).result()  # never idle
        assert not e.known("idle")
        assert e.known("busy")


def test_penalty_prefilter_changes_nothing(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hotloop_serve.engine import sampling

    cases = [
        GREEDY.merged(repeat_penalty=1.5, repeat_last_n=16, sample_len=60),
        SamplingSettings(temperature=0.9, seed=7, top_k=20, repeat_penalty=1.3, repeat_last_n=32, sample_len=60),
    ]

    def run() -> list[str]:
        with Engine(str(tiny_model), EngineOptions(context_tokens=2048, session_context_tokens=1024)) as e:
            return [e.generate(f"s{i}", "a", history(i), s).result().text for i, s in enumerate(cases)]

    assert all(0 < sampling.prefilter_k(s) < 259 for s in cases)
    with_prefilter = run()
    monkeypatch.setattr(sampling, "prefilter_k", lambda s: 0)
    assert run() == with_prefilter


def test_each_sampled_row_is_the_logits_llama_cpp_gives_for_its_batch_index(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine reads a step's logits as one array (one ctypes call, not one per row): row
    ``j`` must be what ``llama_get_logits_ith`` gives for the j-th output's batch index, with
    decoders and prompts' last tokens mixed in one batch and in split steps."""
    import llama_cpp as ll
    import numpy as np

    from hotloop_serve.engine import sampling

    checked: list[bool] = []
    real = sampling.Sampler.sample

    def checking(self: sampling.Sampler, ctx: object, index: int, logits: object = None) -> int:
        n_vocab = len(logits)  # type: ignore[arg-type]
        expected = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
        checked.append(bool(np.array_equal(logits, expected)))  # type: ignore[arg-type]
        return real(self, ctx, index, logits)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling.Sampler, "sample", checking)
    with Engine(str(tiny_model), EngineOptions(context_tokens=4096, session_context_tokens=1024)) as e:
        first = [e.generate(f"s{i}", "a", history(i), GREEDY.merged(sample_len=40 + i)) for i in range(3)]
        while e.stats().steps < 3:  # they decode; newcomers' prompts now join their steps
            time.sleep(0.001)
        later = [e.generate(f"t{i}", "a", history(i + 3), GREEDY.merged(sample_len=20)) for i in range(2)]
        for st in first + later:
            st.result()
    assert len(checked) > 100 and all(checked)


def test_top_candidates_hold_the_top_k_ties_included() -> None:
    import numpy as np

    from hotloop_serve.engine.sampling import top_candidates

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 30, 5000).astype(np.float32)  # spread wider than the first margin
    for k in (1, 40, 104, 4999):
        ids = top_candidates(logits, k)
        assert ids is not None and len(ids) >= k
        assert set(np.argsort(-logits, kind="stable")[:k]) <= set(ids)
        assert list(ids) == sorted(ids)  # vocabulary order, as llama.cpp builds its candidates
    tied = np.zeros(100, dtype=np.float32)
    ids = top_candidates(tied, 3)
    assert ids is not None and len(ids) == 100
    assert top_candidates(np.full(10, -np.inf, dtype=np.float32), 1) is None
    assert top_candidates(np.array([0.0, -np.inf], dtype=np.float32), 2) is None


def test_calls_after_an_engine_failure_fail_fast(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp as ll

    from hotloop_serve.errors import Unavailable

    with Engine(str(tiny_model), EngineOptions(context_tokens=2048, session_context_tokens=1024)) as e:
        e.create_session("s", "a")
        monkeypatch.setattr(ll, "llama_decode", lambda ctx, batch: -3)
        with pytest.raises(Unavailable, match="failed"):
            e.generate("s", "a", history(), GREEDY).result()
        monkeypatch.undo()
        assert not e.alive
        t0 = time.monotonic()
        for call in (lambda: e.clear_cache("s", "a"), lambda: e.generate("s", "a", history(), GREEDY)):
            with pytest.raises(Unavailable):
                call()
        assert time.monotonic() - t0 < 1.0


def test_seed_that_folds_to_llama_cpp_random_sentinel_is_still_reproducible(engine: Engine) -> None:
    from hotloop_serve.engine.sampling import fold_seed

    seed = 0xFFFFFFFF  # folds to 0xFFFFFFFF, llama.cpp's "random seed"
    assert fold_seed(seed) != 0xFFFFFFFF
    s = SamplingSettings(temperature=1.0, seed=seed, sample_len=30, top_k=0, top_p=1.0, min_p=0.0)
    a = engine.generate("x", "a", history(), s).result().text
    b = engine.generate("y", "a", history(), s).result().text
    assert a == b


def test_every_setting_is_bounded_before_anything_is_allocated(engine: Engine) -> None:
    huge = 2**31 - 1
    for field, message in (("repeat_last_n", "repeat_last_n must be <= 1024"), ("sample_len", "sample_len must be <="),
                           ("top_k", "top_k must be <= 259")):  # fmt: skip
        with pytest.raises(InvalidArgument, match=message):
            engine.generate("s", "a", history(), GREEDY.merged(**{field: huge}))
    assert engine.stats().active_requests == 0


def test_per_session_layout_serves_shared_prefixes_without_copying(tiny_model: Path) -> None:
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4, kv_layout="per_session")
    system = M("system", "A long shared system prompt. " * 8)
    with Engine(str(tiny_model), opts) as e:
        assert e.session_context == 1024
        first = e.generate("first", "alice", [system, M("user", "two")], GREEDY).result()
        settle(e)
        second = e.generate("second", "alice", [system, M("user", "two")], GREEDY).result()
    assert second.usage is not None and second.usage.cached_tokens == 0
    assert second.text == first.text


def slow_logged_steps(
    step_s: float,
) -> tuple[Callable[[Model, EngineOptions], ModelRunner], Callable[[Engine], None], list[tuple[set[str], set[str]]]]:
    """A runner whose steps last ``step_s`` more (a slow device) and record their (decoding,
    prefilling) sessions; bind it to its engine once built (its KV manager names the sequences)."""
    log: list[tuple[set[str], set[str]]] = []
    engines: list[Engine] = []

    def logged(pieces: Sequence[Piece]) -> None:
        hot = engines[0].kv.hot  # read on the scheduler thread, inside its step
        log.append(({hot[p.seq].id for p in pieces if p.decoding}, {hot[p.seq].id for p in pieces if not p.decoding}))
        time.sleep(step_s)

    return recording(on_step=logged), engines.append, log


@pytest.mark.parametrize("wait_ms", [50, 0])
def test_a_quick_clients_next_turn_joins_the_step_after_its_reply(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, wait_ms: int
) -> None:
    monkeypatch.setattr(engine_module, "FOLLOWUP_WAIT_STEP_SHARE", 1e6)  # the cap is followup_wait_ms
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4, followup_wait_ms=wait_ms)
    runner, bind, log = slow_logged_steps(step_s=0.03)
    with Engine(str(tiny_model), opts, runner=runner) as e:
        bind(e)
        busy = e.generate("busy", "p", history(1), SamplingSettings(temperature=0, sample_len=800))
        short = SamplingSettings(temperature=0, sample_len=3, repeat_penalty=1.0)
        reply = e.generate("quick", "p", history(), short).result()
        turn2 = [*history(), M("assistant", reply.text), M("user", "and then?")]
        time.sleep(0.015)  # a quick client, but one that lands after the next step has started
        e.generate("quick", "p", turn2, short).result()
        busy.cancel()
    prefills = [k for k, (_, prefilling) in enumerate(log) if "quick" in prefilling]
    first_turn_end, second_turn = prefills[0], prefills[-1]
    decode_steps = sum("quick" in decoding for decoding, _ in log[first_turn_end:second_turn])
    # Its first token came with its prompt's last step, the other 2 from decode steps. Waited
    # for, its next turn's prompt is in the very next step (the old reply's last token is
    # prefilled with it); not waited for, that token is cached in a step of its own first.
    assert decode_steps == (2 if wait_ms else 3)
    quick = e._sessions.get("quick")
    assert quick is not None and quick.return_s is not None and quick.return_s < 0.05


def test_a_slow_client_is_timed_and_its_turn_still_served(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "FOLLOWUP_WAIT_STEP_SHARE", 1e6)
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=4)
    with Engine(str(tiny_model), opts) as e:
        busy = e.generate("busy", "p", history(1), SamplingSettings(temperature=0, sample_len=800))
        first = e.generate("slow", "p", history(), GREEDY).result()
        time.sleep(0.12)  # longer than followup_wait_ms: the engine will not hold a step for it
        turn2 = [*history(), M("assistant", first.text), M("user", "and then?")]
        second = e.generate("slow", "p", turn2, GREEDY).result()
        assert second.text and second.usage is not None and second.usage.cached_tokens > 0
        slow = e._sessions.get("slow")
        assert slow is not None and slow.return_s is not None and slow.return_s >= 0.12
        busy.cancel()


def test_resident_sessions_keep_idle_caches_in_the_pool_beyond_the_running_width(tiny_model: Path) -> None:
    """One request runs at a time, but four sessions stay resident: taking turns evicts nobody,
    and each follow-up finds its whole history hot (no restore, no prefill of the past)."""
    opts = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=1, resident_sessions=4)
    with Engine(str(tiny_model), opts) as e:
        for name in ("a", "b", "c"):
            e.generate(name, "p", history(), GREEDY).result()
            settle(e)
        assert [e.session_info(n, "p").state for n in ("a", "b", "c")] == ["hot", "hot", "hot"]
        follow = e.generate("a", "p", [*history(), M("assistant", "ok"), M("user", "more")], GREEDY).result()
        assert follow.usage is not None and follow.usage.restored_tokens == 0 and follow.usage.cached_tokens > 0
        assert e.stats().evictions == 0
