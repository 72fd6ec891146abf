"""The SDK's error hierarchy, and the one function that turns gRPC errors into it.

Callers catch these instead of ``grpc.RpcError`` so that their code does not depend on the
transport, and so that ``except NotFound`` reads like the API contract. The tree mirrors the
server's (``hotloop_serve/errors.py``) status by status::

    HotloopError                        any failed request; .code, .details
    ├── InvalidArgument      INVALID_ARGUMENT     bad settings, empty history, unknown role
    ├── NotFound             NOT_FOUND            unknown model or session
    ├── OutOfRange           OUT_OF_RANGE         history longer than the context window
    ├── ResourceExhausted    RESOURCE_EXHAUSTED   overload, session limits
    ├── FailedPrecondition   FAILED_PRECONDITION  the session is busy with another request
    ├── Unauthenticated      UNAUTHENTICATED      missing or wrong bearer token
    ├── PermissionDenied     PERMISSION_DENIED    the session belongs to another principal
    ├── Cancelled            CANCELLED            the request was cancelled
    ├── DeadlineExceeded     DEADLINE_EXCEEDED    the call's timeout passed
    ├── Unavailable          UNAVAILABLE          server unreachable or a replica failed
    │   └── TurnInterrupted                       a reply broke off midway; retry the turn
    └── InternalError        INTERNAL             a server bug (or UNKNOWN, DATA_LOSS)

Statuses with no class of their own (UNIMPLEMENTED, ABORTED, ALREADY_EXISTS) raise the
base class with ``.code`` set, so nothing is silently re-labelled.

The server also sends gRPC's richer error model (``google.rpc.Status``, read with
``grpcio-status``): every error carries ``.reason`` (a constant such as ``SESSION_NOT_FOUND``),
``.field_violations`` (``(field, description)`` pairs: fix your request) and ``.retry_delay``
(seconds, when the same request may be retried), so callers never parse ``.details``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class HotloopError(Exception):
    """A request failed. ``code`` is the ``grpc.StatusCode``; ``details`` the server's text."""

    status_code: ClassVar[grpc.StatusCode | None] = None

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.code: grpc.StatusCode = code if code is not None else (self.status_code or grpc.StatusCode.UNKNOWN)
        self.reason: str | None = None
        """``ErrorInfo.reason`` from the server (``SESSION_NOT_FOUND``, ``INVALID_SETTING``...)."""
        self.field_violations: tuple[tuple[str, str], ...] = ()
        """``BadRequest``: the request fields at fault, with why."""
        self.retry_delay: float | None = None
        """``RetryInfo``: seconds after which the same request may succeed; None: do not retry as is."""

    def __str__(self) -> str:
        name = getattr(self.code, "name", str(self.code))
        return f"{name}: {self.details}" if self.details else name


class InvalidArgument(HotloopError):
    """The request was malformed: bad settings, empty history, unknown role."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(HotloopError):
    """The model or session does not exist (or is not the caller's)."""

    status_code = grpc.StatusCode.NOT_FOUND


class OutOfRange(HotloopError):
    """The history does not fit the context window (see ``Settings.truncate_history``)."""

    status_code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(HotloopError):
    """The server hit a bound (queue, sessions, memory); retrying later may succeed."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(HotloopError):
    """The session cannot take this request now (e.g. it is busy with another one)."""

    status_code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(HotloopError):
    """The bearer token is missing or wrong."""

    status_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(HotloopError):
    """The caller may not use this session or model."""

    status_code = grpc.StatusCode.PERMISSION_DENIED


class Cancelled(HotloopError):
    """The request was cancelled (by the server, or by this client on another thread)."""

    status_code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(HotloopError):
    """The call's ``timeout`` passed before the server finished."""

    status_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(HotloopError):
    """The server could not be reached, or the replica serving the request failed.

    The SDK already retried (with backoff) where that was safe; retrying later may succeed.
    """

    status_code = grpc.StatusCode.UNAVAILABLE


class TurnInterrupted(Unavailable):
    """A streamed reply broke off after some text had reached the caller.

    The SDK cannot retry this itself without showing the caller the same text twice, but the
    turn is safe to retry: send the same history again (the server rebuilds the session's
    cache from it on a live replica). ``partial_text`` is what was received before the break.
    """

    def __init__(self, details: str, partial_text: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(
            f"the reply was interrupted after {len(partial_text)} characters ({details}); "
            "retry the turn with the same history",
            code,
        )
        self.partial_text = partial_text


class InternalError(HotloopError):
    """The server failed in a way it did not expect: a bug worth reporting."""

    status_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[Any, type[HotloopError]] = {
    cls.status_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        OutOfRange,
        ResourceExhausted,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        Cancelled,
        DeadlineExceeded,
        Unavailable,
        InternalError,
    )
}
# Statuses that mean "the server broke" without being INTERNAL.
_BY_CODE[grpc.StatusCode.UNKNOWN] = InternalError
_BY_CODE[grpc.StatusCode.DATA_LOSS] = InternalError


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The (code, details) of a gRPC error; works for sync and ``grpc.aio`` errors alike."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    return (code if code is not None else grpc.StatusCode.UNKNOWN), str(details or "")


def error_for_status(code: grpc.StatusCode, details: str) -> HotloopError:
    """The one place a gRPC status becomes an SDK error."""
    return _BY_CODE.get(code, HotloopError)(details, code)


def rich_details(exc: BaseException) -> tuple[str | None, tuple[tuple[str, str], ...], float | None]:
    """(reason, field violations, retry delay) from the ``google.rpc.Status`` trailer of a gRPC
    error, when the server sent one (Ray's own proxy errors carry none)."""
    try:
        status = rpc_status.from_call(exc) if callable(getattr(exc, "trailing_metadata", None)) else None
    except (ValueError, TypeError):  # a trailer that does not match the status: ignore it
        status = None
    reason: str | None = None
    violations: list[tuple[str, str]] = []
    retry: float | None = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry = info.retry_delay.ToMilliseconds() / 1000
    return reason, tuple(violations), retry


def from_rpc_error(exc: BaseException) -> HotloopError:
    """Translate a ``grpc.RpcError`` (sync or aio) into the hierarchy above, with its rich details."""
    error = error_for_status(*status_of(exc))
    error.reason, error.field_violations, error.retry_delay = rich_details(exc)
    return error


__all__ = [
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HotloopError",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "TurnInterrupted",
    "Unauthenticated",
    "Unavailable",
    "error_for_status",
    "from_rpc_error",
    "rich_details",
    "status_of",
]
