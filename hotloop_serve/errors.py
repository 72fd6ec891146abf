"""The one error hierarchy of hotloop-serve.

Every error a request can meet is a :class:`HotloopError` subclass that names its gRPC
status code (as a string, so that this module and the engine need no gRPC import). The
servicer maps them to statuses in one place (``serve/status.py``); the SDK maps statuses
back to its own mirror of this tree. Anything else escaping a request is a bug and becomes
INTERNAL.

    HotloopError
    ├── InvalidArgument      INVALID_ARGUMENT   bad settings, empty history, unknown role
    ├── NotFound             NOT_FOUND          unknown model or session (or not the caller's)
    ├── OutOfRange           OUT_OF_RANGE       history longer than the context window
    ├── ResourceExhausted    RESOURCE_EXHAUSTED a bound was hit (queue, sessions, memory)
    ├── FailedPrecondition   FAILED_PRECONDITION the session is busy with another request
    ├── Unauthenticated      UNAUTHENTICATED    missing or wrong bearer token
    ├── Cancelled            CANCELLED          the caller went away
    ├── DeadlineExceeded     DEADLINE_EXCEEDED
    ├── Unavailable          UNAVAILABLE        the engine is shutting down or failed
    └── InternalError        INTERNAL
"""

from __future__ import annotations


class HotloopError(Exception):
    """Base of every error a request may get; ``code`` is the gRPC status code's name.

    What a client can act on without parsing ``message`` travels as gRPC's richer error model
    (``serve/status.py``): ``reason`` (a constant such as ``SESSION_NOT_FOUND``; default: the
    code), ``field`` (the request field at fault, for INVALID_ARGUMENT: "fix your request") and
    ``retry_after_s`` (when retrying the same request later may succeed: "retry this").
    """

    code: str = "UNKNOWN"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.code
        self.field = field
        self.retry_after_s = retry_after_s


class InvalidArgument(HotloopError):
    code = "INVALID_ARGUMENT"


class NotFound(HotloopError):
    code = "NOT_FOUND"


class OutOfRange(HotloopError):
    code = "OUT_OF_RANGE"


class ResourceExhausted(HotloopError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(HotloopError):
    code = "FAILED_PRECONDITION"


class Unauthenticated(HotloopError):
    code = "UNAUTHENTICATED"


class Cancelled(HotloopError):
    code = "CANCELLED"


class DeadlineExceeded(HotloopError):
    code = "DEADLINE_EXCEEDED"


class Unavailable(HotloopError):
    code = "UNAVAILABLE"


class InternalError(HotloopError):
    code = "INTERNAL"


__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HotloopError",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
]
