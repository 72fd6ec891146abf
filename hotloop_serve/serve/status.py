"""The one place where errors become gRPC statuses on the server.

Every unary RPC reaches it through ``servicer.unary``, Generate through its own handler, and
telemetry may ask :func:`code_of` for the code an error is reported with.

Besides code and text, each status carries gRPC's richer error model (``google.rpc.Status`` in
the ``grpc-status-details-bin`` trailer, what ``grpcio-status`` and its peers in other languages
read): an ``ErrorInfo`` whose ``reason`` is a constant, a ``BadRequest`` naming the field at
fault, and a ``RetryInfo`` when the same request may be retried later. A client in any language
tells "retry this" from "fix your request" without parsing text.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2

from hotloop_serve.errors import HotloopError, InternalError, Unavailable

log = logging.getLogger(__name__)


def replica_failure(error: BaseException) -> Unavailable | None:
    """Ray's word that the replica a call went to died or dropped off (a peer call during a
    hand-over, or an HTTP turn handed to its owner): the caller may retry at once, and the
    session's runner-up takes the turn. Not a bug of ours, so never INTERNAL."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    if isinstance(error, RayActorError | ActorUnavailableError):
        return Unavailable(f"the replica serving this request failed ({type(error).__name__}); retry the request")
    return None


E = TypeVar("E", bound=BaseException)


def known(error: E) -> E | Unavailable:
    """``error``, or the :class:`HotloopError` it stands for (:func:`replica_failure`)."""
    return replica_failure(error) or error


def code_of(error: BaseException) -> grpc.StatusCode:
    """The status code ``error`` reaches the client with.

    A :class:`HotloopError` carries its own; a cancellation (``asyncio.CancelledError``, or
    ``GeneratorExit`` when a stream is closed) means the caller went away: CANCELLED, and the
    servicer re-raises it rather than reply. Anything else is a bug: INTERNAL.
    """
    error = known(error)
    if isinstance(error, HotloopError):
        return grpc.StatusCode[error.code]
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an error; a bug (INTERNAL) is logged with its trace, and its details
    name only its class."""
    error = known(error)
    code = code_of(error)
    if isinstance(error, HotloopError):
        return code, error.message
    if code == grpc.StatusCode.CANCELLED:
        return code, "cancelled by the caller"
    log.exception("unexpected error while serving a request", exc_info=error)
    return code, f"internal error ({type(error).__name__}); the server log has details"


DOMAIN = "hotloop-serve"
"""``ErrorInfo.domain`` of every error this server reports."""
DETAILS_KEY = "grpc-status-details-bin"
"""The trailer carrying the serialized ``google.rpc.Status`` (gRPC's richer error model)."""
RETRY_UNAVAILABLE_S = 0.2
"""``RetryInfo`` of an UNAVAILABLE without one of its own: retry soon (another replica)."""


def rich_status(error: BaseException, code: grpc.StatusCode, details: str) -> status_pb2.Status:
    """``google.rpc.Status`` for ``error``: ErrorInfo always, BadRequest when a field is at
    fault, RetryInfo when the request may be retried as it is."""
    status = status_pb2.Status(code=code.value[0], message=details)
    reason = getattr(error, "reason", None) or code.name
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN))
    field = getattr(error, "field", None)
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=details)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is None and code == grpc.StatusCode.UNAVAILABLE:
        retry_after = RETRY_UNAVAILABLE_S
    if retry_after is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromMilliseconds(round(retry_after * 1000))
        status.details.add().Pack(info)
    return status


def set_status(grpc_context: Any, error: BaseException) -> grpc.StatusCode:
    """Record the status on Ray Serve's gRPC context (the proxy sends it when the method returns),
    with its :func:`rich_status` in the ``grpc-status-details-bin`` trailer."""
    error = known(error)
    code, details = to_status(error)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        set_trailer = getattr(grpc_context, "set_trailing_metadata", None)  # absent from bare test fakes
        if set_trailer is not None and code != grpc.StatusCode.CANCELLED:
            # A list: Ray's context prepends its request_id trailer with ``list + ...``.
            set_trailer([(DETAILS_KEY, rich_status(error, code, details).SerializeToString())])
    elif not isinstance(error, HotloopError):
        raise InternalError(details) from error
    return code
