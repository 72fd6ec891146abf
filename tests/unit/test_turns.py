"""The one error path of a streamed turn (``serve/turns.py``) and the errors the HTTP owner sends."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from hotloop_serve.errors import HotloopError, InvalidArgument, NotFound
from hotloop_serve.serve.turns import Turn, guarded


class FakeStream:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


async def body(turn: Turn, closed: list[str], fail: Exception | None) -> AsyncGenerator[str, None]:
    try:
        turn.stream = FakeStream()  # type: ignore[assignment]
        yield "a"
        if fail is not None:
            raise fail
        yield "b"
    finally:
        closed.append("body")


def run(fail: Exception | None, take: int | None = None) -> tuple[list[str | HotloopError], Turn, list[str]]:
    turn, closed = Turn(), []

    async def main() -> list[str | HotloopError]:
        items = guarded(body(turn, closed, fail), turn, lambda e: e if isinstance(e, HotloopError) else NotFound("x"))
        got: list[str | HotloopError] = []
        async for item in items:
            got.append(item)
            if take is not None and len(got) == take:
                await items.aclose()  # the caller left
                break
        return got

    return asyncio.run(main()), turn, closed


def test_a_finished_turn_is_not_cancelled() -> None:
    got, turn, closed = run(None)
    assert got == ["a", "b"] and closed == ["body"]
    assert not turn.stream.cancelled  # type: ignore[union-attr]


def test_a_failed_turn_cancels_its_request_and_ends_with_the_failure() -> None:
    error = InvalidArgument("bad", field="messages")
    got, turn, closed = run(error)
    assert got == ["a", error] and closed == ["body"]
    assert turn.stream.cancelled  # type: ignore[union-attr]


def test_a_caller_that_leaves_cancels_the_request_and_closes_the_body_at_once() -> None:
    got, turn, closed = run(None, take=1)
    assert got == ["a"] and closed == ["body"]
    assert turn.stream.cancelled  # type: ignore[union-attr]


def test_a_raising_failure_handler_propagates_after_cancelling() -> None:
    turn = Turn()

    def failed(e: Exception) -> str:
        raise e

    async def main() -> None:
        async for _ in guarded(body(turn, [], InvalidArgument("bad")), turn, failed):
            pass

    with pytest.raises(InvalidArgument):
        asyncio.run(main())
    assert turn.stream.cancelled  # type: ignore[union-attr]


def test_an_error_crosses_to_the_receiving_replica_with_its_class_code_and_field() -> None:
    # The HTTP owner sends the HotloopError itself through Ray (pickled), not a dict.
    sent = NotFound("session 'x' not found", reason="SESSION_NOT_FOUND", field="session_id")
    got = pickle.loads(pickle.dumps(sent))
    assert type(got) is NotFound
    assert (got.code, got.message, got.reason, got.field) == (
        "NOT_FOUND",
        sent.message,
        "SESSION_NOT_FOUND",
        "session_id",
    )


def test_local_items_read_like_a_handle_stream_and_cancel_closes_the_turn() -> None:
    """A turn served on its own replica (``openai_http.LocalItems``): read with ``__anext__`` and
    ``async for`` like Ray's streamed response, and ``cancel()`` closes the generator (which ends
    the engine's request), also after the generator finished."""
    from hotloop_serve.serve.openai_http import LocalItems

    closed: list[bool] = []

    async def turn() -> AsyncIterator[int]:
        try:
            for i in range(3):
                yield i
        finally:
            closed.append(True)

    async def main() -> tuple[int, list[int]]:
        items = LocalItems(turn())
        first = await items.__anext__()
        items.cancel()
        await asyncio.sleep(0)
        assert closed == [True]
        rest = LocalItems(turn())
        got = [i async for i in rest]
        rest.cancel()
        await asyncio.sleep(0)
        return first, got

    assert asyncio.run(main()) == (0, [0, 1, 2])
    assert closed == [True, True]
