"""Calls from a replica to its own deployment, each routed as a request of its own.

Ray Serve 2.60's router hands a chosen replica to the pending request with the same
*internal request id* (``RequestRouter._fulfill_next_pending_request``), and a handle call
made while a replica serves a request inherits that request's id. Two calls in flight from
one request (the fetch that asks every peer at once, a settings update sent in the
background while the turn fetches) then share one id: one of them is given the other's
replica or none, and waits until its timeout (measured: every fan-out fetch of a new replica
timed out after 3 s; the routed request reached its replica 10 s later). Running each call
in its own task under a fresh internal id keeps them apart; the user-visible request id
stays, so logs still tie the calls to the turn that made them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.serve import context as serve_context

T = TypeVar("T")


async def as_own_request(make_call: Callable[[], Awaitable[T]]) -> T:
    """Await ``make_call()`` (which must call ``.remote``) as a request of its own."""

    async def run() -> T:
        current = serve_context._get_serve_request_context()
        fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
        serve_context._serve_request_context.set(fresh)  # this task's copy of the context only
        return await make_call()

    return await asyncio.create_task(run())
