"""The one place where errors become gRPC statuses on the server."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from hotloop_serve.errors import HotloopError, InternalError

log = logging.getLogger(__name__)


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an error; anything not a HotloopError is a bug and becomes INTERNAL."""
    if isinstance(error, HotloopError):
        return grpc.StatusCode[error.code], error.message
    log.exception("unexpected error while serving a request", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}); the server log has details"


def set_status(grpc_context: Any, error: BaseException) -> grpc.StatusCode:
    """Record the status on Ray Serve's gRPC context (the proxy sends it when the method returns)."""
    code, details = to_status(error)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
    elif not isinstance(error, HotloopError):
        raise InternalError(details) from error
    return code
