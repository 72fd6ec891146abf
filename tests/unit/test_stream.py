"""Request streams read on an event loop: one loop wake-up per batch of puts, every chunk delivered."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from hotloop_serve.engine.stream import Chunk, RequestStream, StreamPacer, Usage, loop_waker


def test_one_wake_up_for_a_batch_of_streams() -> None:
    """A step's puts on many waiting streams schedule one loop callback, not one per stream."""

    async def main() -> tuple[int, list[str]]:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any) -> Any:
            nonlocal calls
            if getattr(callback, "__name__", "") in ("_fire", "set"):  # not async generators' finalizers
                calls += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        streams = [RequestStream(lambda: None) for _ in range(64)]

        async def first(s: RequestStream) -> str:
            async for chunk in s.chunks():
                return chunk.text
            return ""

        readers = [asyncio.create_task(first(s)) for s in streams]
        await asyncio.sleep(0.01)  # every reader waits on its event
        for i, s in enumerate(streams):  # the scheduler thread's step, as one batch
            s.put(Chunk(f"t{i}"))
        texts = await asyncio.gather(*readers)
        return calls, texts

    calls, texts = asyncio.run(main())
    assert calls == 1
    assert texts == [f"t{i}" for i in range(64)]


def test_puts_from_another_thread_reach_every_reader() -> None:
    async def main() -> list[str]:
        streams = [RequestStream(lambda: None) for _ in range(32)]

        async def whole(s: RequestStream) -> str:
            return (await s.aresult()).text

        readers = [asyncio.create_task(whole(s)) for s in streams]
        await asyncio.sleep(0.01)

        def producer() -> None:
            for step in range(20):
                for s in streams:
                    s.put(Chunk(str(step % 10)))
            for s in streams:
                s.put(Chunk("", finish_reason="length", usage=Usage()))

        thread = threading.Thread(target=producer)
        thread.start()
        texts = await asyncio.gather(*readers)
        thread.join()
        return texts

    assert asyncio.run(main()) == ["01234567890123456789"] * 32


def test_one_waker_per_loop() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        return loop_waker(loop) is loop_waker(loop)

    assert asyncio.run(main())


def _paced(puts: list[tuple[float, str]], pacer: StreamPacer) -> list[tuple[float, str]]:
    """Read one stream through ``pacer`` while a thread puts ``(delay_s, text)`` items; each
    message's arrival (seconds from the start) and text."""

    async def main() -> list[tuple[float, str]]:
        stream = RequestStream(lambda: None)
        t0 = time.perf_counter()

        def producer() -> None:
            for delay, text in puts:
                time.sleep(delay)
                stream.put(Chunk(text))
            stream.put(Chunk("", finish_reason="length", usage=Usage()))

        thread = threading.Thread(target=producer)
        thread.start()
        got = [(time.perf_counter() - t0, c.text) async for c in stream.chunks(pacer=pacer)]
        thread.join()
        return got

    return asyncio.run(main())


def test_a_pacer_merges_tokens_under_load() -> None:
    pacer = StreamPacer(messages_per_s=20.0)
    pacer.active = 1  # with this stream, 2 open: a message every 0.1 s
    got = _paced([(0.005, "x")] * 60, pacer)
    text = "".join(t for _, t in got)
    assert text == "x" * 60
    assert got[0][1] == "x" and got[0][0] < 0.05, "the first token is never held back"
    assert len(got) <= 8, f"0.3 s of tokens in {len(got)} messages"
    assert pacer.active == 1


def test_a_pacer_never_holds_back_a_token_after_a_pause() -> None:
    pacer = StreamPacer(messages_per_s=10.0)  # alone: a message every 0.1 s at most
    got = _paced([(0.0, "a"), (0.3, "b")], pacer)
    assert [t for _, t in got[:2]] == ["a", "b"]
    assert got[1][0] - 0.3 < 0.05, "b came after a pause longer than the gap: sent at once"


def test_no_pacing_without_a_budget() -> None:
    assert StreamPacer(0).gap_s() == 0.0
