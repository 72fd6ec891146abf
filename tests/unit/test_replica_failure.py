"""A replica that died under a call is a retryable UNAVAILABLE, never INTERNAL (the chaos soak's
finding: an HTTP turn handed to an owner that was SIGKILLed answered 500)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from ray.exceptions import ActorDiedError, ActorUnavailableError

from hotloop_serve.errors import Unavailable
from hotloop_serve.serve import status
from hotloop_serve.serve.openai_http import ErrorsAsItems, error_response


def test_ray_replica_failures_are_unavailable_with_retry_advice() -> None:
    for error in (ActorDiedError(), ActorUnavailableError("gone", b"\0" * 16)):
        code, details = status.to_status(error)
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "retry" in details
        rich = status.rich_status(status.known(error), code, details)
        assert any(d.type_url.endswith("RetryInfo") for d in rich.details)
    assert status.code_of(ValueError("a bug")) == grpc.StatusCode.INTERNAL


def test_an_http_turn_whose_owner_died_is_a_503() -> None:
    response = error_response(ActorDiedError())
    assert response.status_code == 503


class _Stream:
    """A handle's streamed response that yields one item, then dies with its replica."""

    def __init__(self) -> None:
        self.items: list[Any] = [{"text": "a"}]
        self.cancelled = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        raise ActorDiedError()

    def cancel(self) -> None:
        self.cancelled = True


def test_a_stream_whose_owner_died_ends_with_an_unavailable_item() -> None:
    async def read() -> list[Any]:
        items = ErrorsAsItems(_Stream())
        return [item async for item in items]

    got = asyncio.run(read())
    assert got[0] == {"text": "a"}
    assert isinstance(got[1], Unavailable) and len(got) == 2
