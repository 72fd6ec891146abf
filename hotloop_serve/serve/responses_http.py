"""The receiving replica's half of ``/v1/responses``: the owner's items as a response or its events.

The owner (``openai_http.OpenAIApi.OpenAIRespond``) yields a ``start`` item (the
response in progress and its message item's id), text and call pieces, then a last item
carrying the finished ``response`` (as stored) and the ``hotloop`` extension. An error is a
:class:`~hotloop_serve.errors.HotloopError` item, as for chat completions.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from hotloop_serve.errors import HotloopError
from hotloop_serve.serve import openai_schema as oa
from hotloop_serve.serve.responses_schema import EventWriter

MAX_LIST = 100


async def collect_response(items: Any) -> Response:
    """A non-streaming response: the owner's last item holds it whole."""
    try:
        async for item in items:
            if isinstance(item, HotloopError):
                status, body = oa.error_of(item)
                return JSONResponse(body, status_code=status)
            if "response" in item:
                body = dict(item["response"])
                body["hotloop"] = item["hotloop"]
                return JSONResponse(body)
    finally:
        items.cancel()
    status, body = oa.error_json("INTERNAL", "the response ended without a result")
    return JSONResponse(body, status_code=status)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def response_events(first: dict[str, Any], items: Any) -> AsyncIterator[bytes]:
    """The spec's typed server-sent events, ``response.created`` to ``response.completed``; an
    error after the stream started is an ``error`` event (the OpenAI SDKs raise it)."""
    start = first["start"]
    writer = EventWriter(start["response"], start["message_id"])
    try:
        for kind, data in writer.start():
            yield _sse(kind, data)
        async for item in items:
            if isinstance(item, HotloopError):
                kind, data = writer.error(item.code, item.message, item.field)
                yield _sse(kind, data)
                return
            for kind, data in writer.item(item):
                yield _sse(kind, data)
            if "response" in item:
                body = dict(item["response"])
                body["hotloop"] = item["hotloop"]
                for kind, data in writer.finish(body):
                    yield _sse(kind, data)
                return
    finally:
        items.cancel()


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of a response's input items."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [i["id"] for i in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[: max(1, min(limit, MAX_LIST))]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }
