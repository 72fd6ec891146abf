"""What a caller reads from a request: chunks handed over from the scheduler thread.

The scheduler thread only appends (never blocks on a reader); readers on other threads
iterate synchronously, readers on an event loop iterate asynchronously. A reader that
stops early (break, task cancel, a client gone) cancels the request, which leaves the
batch at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from hotloop_serve.errors import HotloopError


@dataclass(slots=True)
class Usage:
    """Where a request's prompt tokens came from, and how many it generated."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class Timings:
    """Milliseconds spent waiting for a sequence, prefilling, to the first token, decoding."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    decode_ms: float = 0.0


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability (natural log, the model's raw distribution) and,
    when asked for, the most likely alternatives at its position, best first."""

    token: int
    piece: bytes
    """The token's bytes (a token may hold part of a UTF-8 character)."""
    logprob: float
    top: list[tuple[int, bytes, float]] = field(default_factory=list)
    """(token, bytes, logprob) of the ``top_logprobs`` most likely tokens."""


@dataclass(slots=True)
class Chunk:
    """Streamed text; the last chunk of a request carries finish_reason, usage and timings."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    cache_hit: bool = False
    logprobs: list[TokenLogprob] | None = None
    """With ``SamplingSettings.logprobs``: the tokens generated since the previous chunk (a
    chunk's text may lag its tokens: text held back for a stop sequence or a split character)."""

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


class LoopWaker:
    """Wakes the waiting readers of one event loop: one ``call_soon_threadsafe`` per batch of puts.

    A step puts a chunk on every running stream (up to ``hot_sessions`` of them) within a
    millisecond. One callback per stream would write the loop's self-pipe, and queue a
    callback, once per stream and step; here the first put of a batch schedules one callback
    and the puts that follow, until it runs, only add their reader's event to it: the loop
    wakes once per step for all its streams.
    """

    __slots__ = ("_lock", "_loop", "_pending", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # weak: the registry's key must not be kept alive by its value
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []
        self._scheduled = False

    def wake(self, event: asyncio.Event) -> None:
        """Set ``event`` on the loop soon (any thread)."""
        with self._lock:
            self._pending.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop gone")
            loop.call_soon_threadsafe(self._fire)
        except RuntimeError:  # the loop is closed or gone: nobody listens
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _fire(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for event in pending:
            event.set()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def loop_waker(loop: asyncio.AbstractEventLoop) -> LoopWaker:
    """The one :class:`LoopWaker` of ``loop`` (created on first use, gone with the loop)."""
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            waker = _wakers[loop] = LoopWaker(loop)
        return waker


class StreamPacer:
    """Spaces the messages of one event loop's streams to a budget of messages per second, so
    that under load each message carries several tokens and an idle replica delays none.

    Every streamed message costs the RPC layers behind the reader (Ray Serve's per-item
    serialization, its proxy, the client) about the same whatever it carries, and a replica
    fed at an accelerator's rate (a token per session every 10-30 ms, 64-256 sessions) would
    otherwise send one message per token. With ``active`` streams open, a stream sends at
    most one message every ``active / messages_per_s`` seconds, measured from its previous
    message: the tokens decoded meanwhile travel together. A stream's first message, and any
    message after a pause longer than that gap, go out at once; with few streams the gap is
    below a step and nothing waits. Event-loop thread only (no lock).
    """

    __slots__ = ("active", "messages_per_s")

    def __init__(self, messages_per_s: float) -> None:
        self.messages_per_s = messages_per_s
        """0: no pacing."""
        self.active = 0
        """Streams being read through this pacer now."""

    def gap_s(self) -> float:
        """The least time between two messages of one stream now."""
        return self.active / self.messages_per_s if self.messages_per_s > 0 else 0.0


class RequestStream:
    """A one-producer queue of chunks (or one error) with sync and async readers."""

    __slots__ = ("_cancel", "_cond", "_done", "_event", "_items", "_waiting", "_waker", "finished")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._items: deque[Chunk | HotloopError] = deque()
        self._cond = threading.Condition()
        self._waker: LoopWaker | None = None
        self._event: asyncio.Event | None = None
        self._cancel = cancel
        self._done = False
        self._waiting = False
        """An async reader found nothing and awaits the event: only then is a wake-up owed (a
        reader that is busy or sleeping out its coalescing window reads what it finds later,
        so no event-loop wake-up per token)."""
        self.finished = False

    # -- producer side (scheduler thread) --
    def put(self, item: Chunk | HotloopError) -> None:
        with self._cond:
            if self._done:
                return
            self._items.append(item)
            if isinstance(item, HotloopError) or item.final:
                self._done = True
            self._cond.notify()
            waker, event = self._waker, self._event
            wake, self._waiting = self._waiting, False
        if wake and waker is not None and event is not None:
            waker.wake(event)

    # -- consumer side --
    def cancel(self) -> None:
        """Stop the request (idempotent); the scheduler drops it at its next step."""
        if not self.finished:
            self._cancel()

    def _take(self) -> list[Chunk | HotloopError]:
        items = list(self._items)
        self._items.clear()
        return items

    @staticmethod
    def _merge(items: list[Chunk | HotloopError]) -> Chunk | HotloopError:
        """Coalesce what arrived since the last read: one chunk per read keeps RPC overhead per read, not per token."""
        for item in items:
            if isinstance(item, HotloopError):
                return item
        chunks = [c for c in items if isinstance(c, Chunk)]
        if len(chunks) == 1:
            return chunks[0]
        last = chunks[-1]
        last.text = "".join(c.text for c in chunks)
        if last.logprobs is not None or chunks[0].logprobs is not None:
            last.logprobs = [lp for c in chunks for lp in (c.logprobs or ())]
        return last

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                with self._cond:
                    while not self._items:
                        self._cond.wait()
                    item = self._merge(self._take())
                if isinstance(item, HotloopError):
                    self.finished = True
                    raise item
                if item.final:
                    self.finished = True
                yield item
                if item.final:
                    return
        finally:
            self.cancel()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self.chunks()

    async def chunks(self, coalesce_s: float = 0.0, pacer: StreamPacer | None = None) -> AsyncIterator[Chunk]:
        """The chunks, read on an event loop. ``coalesce_s`` > 0: after a chunk, wait that long
        before the next read, so the tokens decoded meanwhile travel as one chunk (fewer messages
        through the RPC layers per token); the first chunk and errors are never delayed.
        ``pacer``: the same, by a gap that grows with the streams open (:class:`StreamPacer`)."""
        event = asyncio.Event()
        with self._cond:
            self._waker, self._event = loop_waker(asyncio.get_running_loop()), event
        if pacer is not None:
            pacer.active += 1
        try:
            while True:
                with self._cond:
                    items = self._take()
                    if not items:
                        event.clear()
                        self._waiting = True
                if not items:
                    await event.wait()
                    continue
                item = self._merge(items)
                if isinstance(item, HotloopError):
                    self.finished = True
                    raise item
                if item.final:
                    self.finished = True
                yield item
                if item.final:
                    return
                if coalesce_s > 0:
                    await asyncio.sleep(coalesce_s)
                elif pacer is not None:
                    gap = pacer.gap_s()
                    if gap > 0:
                        # From this message on: the next one waits only for what is left of the gap.
                        sent = time.perf_counter()
                        await self._pause(event, sent + gap)
        finally:
            if pacer is not None:
                pacer.active -= 1
            self.cancel()

    async def _pause(self, event: asyncio.Event, until: float) -> None:
        """Wait until ``until`` unless nothing arrives meanwhile: then the next item, whenever it
        comes, goes out at once if the gap has passed (an idle stream is never held back)."""
        with self._cond:
            if not self._items:  # nothing yet: wait for it first, the gap may pass meanwhile
                event.clear()
                self._waiting = True
                wait_first = True
            else:
                wait_first = False
        if wait_first:
            await event.wait()
        left = until - time.perf_counter()
        if left > 0:
            await asyncio.sleep(left)

    def result(self) -> Chunk:
        """Wait for the end and return the final chunk, text joined (for warmup and tests)."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        last = Chunk()
        for chunk in self:
            text.append(chunk.text)
            logprobs.extend(chunk.logprobs or ())
            last = chunk
        last.text = "".join(text)
        if logprobs:
            last.logprobs = logprobs
        return last

    async def aresult(self) -> Chunk:
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        last = Chunk()
        async for chunk in self:
            text.append(chunk.text)
            logprobs.extend(chunk.logprobs or ())
            last = chunk
        last.text = "".join(text)
        if logprobs:
            last.logprobs = logprobs
        return last
