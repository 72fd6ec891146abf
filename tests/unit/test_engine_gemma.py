"""The engine on the bundled Gemma 3 270M (no server): what a tiny model cannot show.

Gemma 3's sliding-window layers (5 of 6 see only the last 512 positions) and a real
vocabulary make these the cases where a cache can silently go wrong: cells reused behind a
session's window, and a pool that fills while replies grow.
"""

from __future__ import annotations

import time
from pathlib import Path

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
