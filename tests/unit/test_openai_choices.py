"""``n`` > 1 on chat completions: each choice's seed and the merging of the choices' items."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import ResourceExhausted
from hotloop_serve.serve.openai_choices import choice_settings, derived_seed, merge_choices

PROMPT = {"cached_tokens": 5, "restored_tokens": 2, "prefilled_tokens": 3}


def test_a_seeded_request_gives_each_choice_its_own_seed_and_choice_0_the_request_s() -> None:
    seeds = [s.seed for s in choice_settings(SamplingSettings(seed=7), 4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [s.seed for s in choice_settings(SamplingSettings(seed=7), 4)]  # reproducible
    assert derived_seed(8, 1) not in seeds  # a neighbouring seed's choices are not these shifted
    assert all(0 <= derived_seed(2**64 - 1, i) < 2**64 for i in range(8))
    unseeded = choice_settings(SamplingSettings(), 3)
    assert [s.seed for s in unseeded] == [None] * 3  # the engine draws a fresh seed per request


async def reply(texts: list[str], completion: int, delay: float, fail: bool = False) -> AsyncIterator[dict[str, Any]]:
    for text in texts:
        await asyncio.sleep(delay)
        yield {"text": text}
    if fail:
        raise ResourceExhausted("full")
    yield {
        "text": "",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 10, "completion_tokens": completion, "cached_tokens": 9},
        "hotloop": {"usage": {"cached_tokens": 9}, "timings": {}},
    }


def collect(replies: list[AsyncIterator[dict[str, Any]]]) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        return [item async for item in merge_choices(replies, PROMPT)]

    return asyncio.run(main())


def test_choices_interleave_with_their_index_and_the_last_item_sums_the_usage() -> None:
    items = collect([reply(["a", "b"], 2, 0.01), reply(["x", "y", "z"], 3, 0.003)])
    by_index = {i: "".join(it["text"] for it in items if it["index"] == i) for i in (0, 1)}
    assert by_index == {0: "ab", 1: "xyz"}
    finals = [it for it in items if "finish_reason" in it]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert [i for i, it in enumerate(items) if "usage" in it] == [len(items) - 1]  # only the turn's end
    last = items[-1]
    assert last["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 7}
    assert last["hotloop"]["usage"] == PROMPT


def test_a_failing_choice_ends_the_turn_and_cancels_the_others() -> None:
    cancelled: list[bool] = []

    async def endless() -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield {"text": "."}
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(ResourceExhausted):
        collect([endless(), reply(["a"], 1, 0.005, fail=True)])
    assert cancelled == [True]
