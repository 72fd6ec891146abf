"""The one place where errors become gRPC statuses on the server.

Every unary RPC reaches it through ``servicer.unary``, Generate through its own handler, and
telemetry may ask :func:`code_of` for the code an error is reported with.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from hotloop_serve.errors import HotloopError, InternalError

log = logging.getLogger(__name__)


def code_of(error: BaseException) -> grpc.StatusCode:
    """The status code ``error`` reaches the client with.

    A :class:`HotloopError` carries its own; a cancellation (``asyncio.CancelledError``, or
    ``GeneratorExit`` when a stream is closed) means the caller went away: CANCELLED, and the
    servicer re-raises it rather than reply. Anything else is a bug: INTERNAL.
    """
    if isinstance(error, HotloopError):
        return grpc.StatusCode[error.code]
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an error; a bug (INTERNAL) is logged with its trace, and its details
    name only its class."""
    code = code_of(error)
    if isinstance(error, HotloopError):
        return code, error.message
    if code == grpc.StatusCode.CANCELLED:
        return code, "cancelled by the caller"
    log.exception("unexpected error while serving a request", exc_info=error)
    return code, f"internal error ({type(error).__name__}); the server log has details"


def set_status(grpc_context: Any, error: BaseException) -> grpc.StatusCode:
    """Record the status on Ray Serve's gRPC context (the proxy sends it when the method returns)."""
    code, details = to_status(error)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
    elif not isinstance(error, HotloopError):
        raise InternalError(details) from error
    return code
