"""The engine on the bundled Gemma 3 270M (no server): what a tiny model cannot show.

Gemma 3's sliding-window layers (5 of 6 see only the last 512 positions) and a real
vocabulary make these the cases where a cache can silently go wrong: cells reused behind a
session's window, and a pool that fills while replies grow.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hotloop_serve.engine import ChatMessage as M
from hotloop_serve.engine import Engine, EngineOptions, SamplingSettings

GREEDY = SamplingSettings(temperature=0, sample_len=24, repeat_penalty=1.0)


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def settle(e: Engine) -> None:
    while e.stats().active_requests:
        time.sleep(0.01)


def test_sliding_window_cells_reused_behind_a_session_are_never_used_as_its_context(gemma_model: Path) -> None:
    """A shared prefix and an edited early turn, after the owner ran >1,000 tokens further with
    its slot search moved back to cell 0: both give the text of the same history on a fresh engine."""
    opening = [
        M("user", "Remember these words: " + words(150, "alpha")),
        M("assistant", "Done."),
        M("user", "And these: " + words(100, "beta")),
    ]
    opts = EngineOptions(context_tokens=4096, session_context_tokens=4096, hot_sessions=4)
    with Engine(str(gemma_model), opts) as e:
        e.generate("filler", "p", [M("user", "filler " + words(200, "gamma"))], GREEDY).result()
        settle(e)
        first = e.generate("x", "p", opening, GREEDY).result()
        settle(e)
        e.close_session("filler", "p")  # frees the first cells: the slot search starts over there
        further = [*opening, M("assistant", first.text), M("user", "Now this: " + words(600, "delta"))]
        long_turn = e.generate("x", "p", further, GREEDY).result()
        assert long_turn.usage is not None and long_turn.usage.prefilled_tokens > 1000
        settle(e)
        fork = [*opening, M("assistant", first.text), M("user", "What was the first word?")]
        forked = e.generate("z", "p", fork, GREEDY).result()  # shares x's prefix (same principal)
        settle(e)
        edit = [opening[0], M("assistant", "Done."), M("user", "Something else entirely?")]
        edited = e.generate("x", "p", edit, GREEDY).result()  # cuts x back to its first turn
        assert e.stats().window_resets >= 1
    with Engine(str(gemma_model), opts) as fresh:
        assert forked.text == fresh.generate("f1", "p", fork, GREEDY).result().text
        assert edited.text == fresh.generate("f2", "p", edit, GREEDY).result().text


def test_eight_replies_that_outgrow_the_pool_all_complete(gemma_model: Path) -> None:
    """context_tokens 4096, 8 sessions of ~300-token prompts and 256-token replies: before
    pre-emption, 0 of 8 completed (all RESOURCE_EXHAUSTED)."""
    opts = EngineOptions(context_tokens=4096, session_context_tokens=4096, hot_sessions=8)
    settings = SamplingSettings(temperature=0.7, seed=1, sample_len=256, repeat_penalty=1.0)
    with Engine(str(gemma_model), opts) as e:
        streams = [
            e.generate(f"s{i}", "p", [M("user", f"Story {i}: write a long tale about " + words(130, "w"))], settings)
            for i in range(8)
        ]
        results = [s.result() for s in streams]
        stats = e.stats()
    assert all(r.finish_reason in ("length", "eos", "stop") for r in results)
    total = sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in results if r.usage)
    if total > 4096:
        assert stats.preemptions > 0


def test_sampling_among_the_decisive_candidates_draws_what_the_whole_row_draws(
    gemma_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler hands llama.cpp's chain only the candidates near the best logit (262,144 in
    Gemma's vocabulary otherwise); every setting that cuts to a top-k draws the same tokens."""
    from hotloop_serve.engine import sampling

    cases = [
        GREEDY.merged(sample_len=40),
        GREEDY.merged(repeat_penalty=1.5, repeat_last_n=16, sample_len=40),
        *(
            SamplingSettings(temperature=t, seed=seed, top_k=k, top_p=p, min_p=0.02, sample_len=40, repeat_penalty=1.0)
            for seed, (t, k, p) in enumerate([(0.7, 40, 0.95), (1.5, 200, 1.0), (1.0, 1, 0.9)])
        ),
        SamplingSettings(seed=7, sample_len=40),  # the defaults: penalty 1.1 over the last 64
    ]
    cut: list[int] = []
    real = sampling.top_candidates

    def counted(logits: Any, k: int) -> Any:
        ids = real(logits, k)
        cut.append(len(ids) if ids is not None else len(logits))
        return ids

    def run() -> list[list[int]]:
        with Engine(str(gemma_model), EngineOptions(context_tokens=4096, session_context_tokens=2048, threads=2)) as e:
            replies = []
            for i, s in enumerate(cases):
                history = [M("user", f"Write a short poem about the number {i}.")]
                chunk = e.generate(f"s{i}", "a", history, s.merged(logprobs=True)).result()
                replies.append([lp.token for lp in chunk.logprobs or ()])
            return replies

    assert all(sampling.decisive_k(s) > 0 for s in cases)
    monkeypatch.setattr(sampling, "top_candidates", counted)
    among_decisive = run()
    assert all(len(tokens) >= 10 for tokens in among_decisive)
    assert cut and max(cut) < 262_144 // 8  # the chain saw a sliver of the vocabulary
    monkeypatch.setattr(sampling, "decisive_k", lambda s: 0)
    assert run() == among_decisive
