"""The one error path of a streamed turn, shared by gRPC's ``Generate`` and the HTTP API's turns.

A streamed turn holds an engine request (:class:`~hotloop_serve.engine.stream.RequestStream`)
for as long as its caller reads. Whatever ends the stream early must cancel that request, or
the engine keeps decoding for nobody:

- the caller left (a client's cancel or deadline, Ray closing the stream): the request is
  cancelled and the exit goes on (``GeneratorExit`` / ``CancelledError`` re-raised, never
  reported as an error);
- the turn failed (a :class:`~hotloop_serve.errors.HotloopError`, or a bug): the request is
  cancelled and the protocol reports the failure its own way (``failed``): gRPC sets the
  status and raises, the HTTP owner yields the error as an item for the receiving replica.

Submitting off the event loop (:func:`submit`) is part of the same contract: a cancel that
arrives while the submission runs in its thread cancels the request as soon as it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from hotloop_serve.engine.stream import RequestStream

T = TypeVar("T")
F = TypeVar("F")


class Turn:
    """The engine request of one streamed turn, once submitted (None before); ``others``: more
    requests of the same turn (the prompt's prefill and the choices of a chat's ``n`` > 1)."""

    __slots__ = ("others", "stream")

    def __init__(self) -> None:
        self.stream: RequestStream | None = None
        self.others: list[RequestStream] = []

    def cancel(self) -> None:
        for stream in (self.stream, *self.others):
            if stream is not None:
                stream.cancel()


async def guarded(
    body: AsyncGenerator[T, None], turn: Turn, failed: Callable[[Exception], F]
) -> AsyncGenerator[T | F, None]:
    """Yield ``body``'s items; on an early end cancel ``turn``'s request (see the module docstring).

    ``body`` is closed here on every exit (``aclosing``), so its own ``finally`` blocks (a span,
    a session marked busy) run before the stream ends, not whenever it is collected. ``failed``
    turns an error into the last item, or raises it.
    """
    try:
        async with contextlib.aclosing(body) as items:
            async for item in items:
                yield item
    except (GeneratorExit, asyncio.CancelledError):
        turn.cancel()
        raise
    except Exception as e:
        turn.cancel()
        yield failed(e)


async def submit(start: Callable[[], RequestStream]) -> RequestStream:
    """Submit a request to the engine off the event loop, orphaning nothing.

    A client's cancel or deadline can arrive while the submission is still running in its
    thread; the request then gets cancelled as soon as it exists, instead of running for a
    caller that left.
    """
    task = asyncio.ensure_future(asyncio.to_thread(start))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_cancel_submitted)
        raise


def _cancel_submitted(task: asyncio.Future[RequestStream]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().cancel()
