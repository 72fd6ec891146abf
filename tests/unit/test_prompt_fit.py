"""Fitting a history into the session's window (``engine/prompt_fit.py``), with no model: a
message renders to as many tokens as its content has characters."""

from __future__ import annotations

import pytest

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.prompt_fit import fit_prompt
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import OutOfRange

TRUNCATE = SamplingSettings(truncate_history=True, sample_len=10)
renders: list[list[ChatMessage]] = []


def render(messages: list[ChatMessage]) -> list[int]:
    renders.append(messages)
    return [len(m.content) for m in messages for _ in m.content]


def history(*sizes: int, system: int = 0) -> list[ChatMessage]:
    head = [ChatMessage("system", "s" * system)] if system else []
    return head + [ChatMessage("user" if i % 2 == 0 else "assistant", "x" * n) for i, n in enumerate(sizes)]


def test_a_prompt_that_fits_is_kept_as_rendered() -> None:
    msgs = history(10, 10)
    prompt = render(msgs)
    assert fit_prompt(prompt, msgs, SamplingSettings(), 21, True, render) is prompt  # 20 + a reply's token


def test_a_prompt_over_the_window_fails_unless_truncation_is_allowed() -> None:
    msgs = history(10, 10)
    with pytest.raises(OutOfRange, match="history is 20 tokens but a session holds at most 20"):
        fit_prompt(render(msgs), msgs, SamplingSettings(), 20, True, render)
    assert fit_prompt(render(msgs), msgs, SamplingSettings(), 20, False, render) == render(msgs)  # a warmup


def test_truncation_drops_the_fewest_oldest_turns_keeping_the_system_message_and_room_to_reply() -> None:
    msgs = history(30, 30, 30, 5, system=5)
    fitted = fit_prompt(render(msgs), msgs, TRUNCATE, 80, True, render)
    # 5 (system) + 30 + 30 + 5 = 70, + 10 of headroom for the reply: one turn dropped
    assert fitted == render([msgs[0], *msgs[2:]])


def test_a_last_message_alone_over_the_window_fails() -> None:
    msgs = history(30, 100)
    with pytest.raises(OutOfRange, match="the last message alone renders to 100 tokens"):
        fit_prompt(render(msgs), msgs, TRUNCATE, 50, True, render)


def test_truncation_renders_logarithmically_many_candidates() -> None:
    msgs = history(*([10] * 64))
    renders.clear()
    fit_prompt(render(msgs), msgs, TRUNCATE, 100, True, render)
    assert len(renders) <= 8  # the first render plus a binary search over 63 turns
