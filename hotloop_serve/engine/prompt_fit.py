"""Fitting a conversation's prompt into its session's window.

A turn's history must fit the session's context (the prompt, plus one token for a reply to
begin). When it does not, the request fails with OUT_OF_RANGE unless its settings allow
``truncate_history``: then the oldest turns are dropped (a leading system message is kept,
and always the last message), leaving room for a reply of ``sample_len`` tokens, up to a
quarter of the window. Pure: it only renders candidate histories through the caller's
``render``, on the caller's thread (never the scheduler's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hotloop_serve.engine.chat_template import ChatMessage
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import OutOfRange


def fit_prompt(
    prompt: list[int],
    messages: Sequence[ChatMessage],
    settings: SamplingSettings,
    window: int,
    generate: bool,
    render: Callable[[list[ChatMessage]], list[int]],
) -> list[int]:
    """``prompt`` (``messages`` rendered) if it fits ``window``, else the prompt of the fewest
    oldest turns dropped that leaves a reply its headroom, when ``settings`` allow it.

    ``generate``: a reply follows (a warmup needs no token for it). Truncation binary-searches
    how many turns to drop: O(log n) renders of the history, not one per dropped turn.
    """
    limit = window - (1 if generate else 0)
    if len(prompt) <= limit:
        return prompt
    if not settings.truncate_history:
        raise OutOfRange(
            f"history is {len(prompt)} tokens but a session holds at most {window} "
            f"(prompt + reply); shorten the history or set truncate_history"
        )
    msgs = list(messages)
    keep_system = 1 if msgs and msgs[0].role == "system" else 0
    headroom = min(settings.sample_len, window // 4)

    def render_dropping(k: int) -> list[int]:
        return render([*msgs[:keep_system], *msgs[keep_system + k :]])

    lo, hi = 1, len(msgs) - keep_system - 1  # drop at least one turn, keep the last message
    best: list[int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = render_dropping(mid)
        if len(candidate) + headroom <= window:
            best, hi = candidate, mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    last = render_dropping(max(len(msgs) - keep_system - 1, 0))
    if len(last) <= limit:
        return last
    raise OutOfRange(
        f"the last message alone renders to {len(last)} tokens, over the session window of {window}; shorten it"
    )
