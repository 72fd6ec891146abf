"""``n`` > 1 on chat completions: n choices of one prompt, as one stream of items.

The owner prefills the prompt once into the conversation's session, forks that session n-1
ways (``Engine.fork_session``: the KV is copied, not prefilled again) and runs the n replies
as n engine requests, which decode together in the engine's batch. Everything happens on the
owner, inside the one turn the receiving replica handed it (or the one it serves in place):
the earlier design, n turns fanned out through Ray's streaming handle calls, stalled under
load, so no choice here is ever a handle call of its own.

This module holds the parts that are not the engine's: each choice's seed
(:func:`choice_settings`) and the merging of the n replies' items into one stream
(:func:`merge_choices`), each item tagged with its choice's ``index``; the last item to end
the turn carries the usage of all n (the prompt counted once) and the ``hotloop`` extension.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from hotloop_serve.engine.settings import MAX_SEED, SamplingSettings


def derived_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's own for choice 0 (so ``n: 1`` and choice 0 of a
    larger ``n`` are the same reply), a hash of it for the others, so that no two choices, nor
    the choices of two neighbouring seeds, share a random stream."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"hotloop-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def choice_settings(settings: SamplingSettings, n: int) -> list[SamplingSettings]:
    """The settings of each of ``n`` choices: a fixed seed is derived per choice (unseeded
    requests draw a fresh seed each, and greedy ones ignore it: their choices are identical)."""
    if settings.seed is None:
        return [settings] * n
    return [settings.merged(seed=derived_seed(settings.seed, i)) for i in range(n)]


async def merge_choices(
    replies: Sequence[AsyncIterator[dict[str, Any]]], prompt_cache: dict[str, int]
) -> AsyncGenerator[dict[str, Any], None]:
    """The replies' items as they arrive, each tagged with its ``index``.

    Each reply's last item has ``finish_reason``, ``usage`` and ``hotloop``; here only the turn's
    last such item keeps ``usage`` (completion tokens summed, the prompt's tokens counted once,
    ``cached_tokens`` what the shared prompt reused: ``prompt_cache``) and ``hotloop`` (choice 0's,
    its ``usage`` the shared prompt's: ``prompt_cache``). A reply that fails ends the turn: its
    error is raised, the others are cancelled."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException]] = asyncio.Queue()

    async def pump(index: int, items: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in items:
                await queue.put((index, item))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported to the reader, which ends the turn
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(replies)]
    try:
        left, completion = len(replies), 0
        finals: dict[int, dict[str, Any]] = {}
        while left:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            item["index"] = index
            if "finish_reason" in item:
                left -= 1
                usage, hotloop = item.pop("usage"), item.pop("hotloop")
                completion += usage["completion_tokens"]
                finals[index] = {"usage": usage, "hotloop": hotloop}
                if not left:
                    first = finals[0]
                    item["usage"] = {
                        "prompt_tokens": first["usage"]["prompt_tokens"],
                        "completion_tokens": completion,
                        "cached_tokens": prompt_cache["cached_tokens"] + prompt_cache["restored_tokens"],
                    }
                    item["hotloop"] = {**first["hotloop"], "usage": dict(prompt_cache)}
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
