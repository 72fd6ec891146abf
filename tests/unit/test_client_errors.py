"""The SDK's error hierarchy and its retry rules, without a server.

The hierarchy is part of the public API (callers write ``except NotFound``), so these tests
pin the status -> class table, the tree documented in ``_errors.py``, and the rules that
decide when a failed call is silently retried and when the caller must see it.
"""

from __future__ import annotations

import re

import grpc
import hotloop_client
import pytest
from hotloop_client import (
    Cancelled,
    Chunk,
    DeadlineExceeded,
    FailedPrecondition,
    HotloopError,
    InternalError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    TurnInterrupted,
    Unauthenticated,
    Unavailable,
    _errors,
)
from hotloop_client._base import MAX_ATTEMPTS, StreamProgress, is_failover, should_retry_unary
from hotloop_client._errors import error_for_status, from_rpc_error

EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


class FakeRpcError(grpc.RpcError):  # type: ignore[misc]
    """Shaped like the errors grpc raises: ``code()`` and ``details()`` methods."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_every_status_maps_to_its_class(code: grpc.StatusCode) -> None:
    if code == grpc.StatusCode.OK:
        return
    error = error_for_status(code, "why")
    assert type(error) is EXPECTED.get(code, HotloopError)
    assert error.code == code
    assert error.details == "why"
    assert str(error) == f"{code.name}: why"


def test_from_rpc_error_reads_code_and_details() -> None:
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "no session s-1"))
    assert isinstance(error, NotFound)
    assert error.details == "no session s-1"
    unknown = from_rpc_error(RuntimeError("not a grpc error"))
    assert isinstance(unknown, InternalError) and unknown.code == grpc.StatusCode.UNKNOWN


def test_docstring_tree_matches_the_classes() -> None:
    """The tree that opens ``_errors.py`` is the documentation: it must stay true."""
    tree = (_errors.__doc__ or "").split("::", 1)[1].split("\n\n")[1]
    parents: list[tuple[int, type[HotloopError]]] = []
    documented: set[type[HotloopError]] = set()
    for line in tree.splitlines():
        match = re.match(r"^([\s│├└─]*)(\w+)", line)
        assert match, line
        depth, cls = len(match.group(1)), getattr(hotloop_client, match.group(2))
        while parents and parents[-1][0] >= depth:
            parents.pop()
        if parents:
            assert cls.__mro__[1] is parents[-1][1], f"{cls.__name__} is not under {parents[-1][1].__name__}"
        parents.append((depth, cls))
        documented.add(cls)
    exported = {
        obj
        for obj in (getattr(hotloop_client, name) for name in hotloop_client.__all__)
        if isinstance(obj, type) and issubclass(obj, HotloopError)
    }
    assert documented == exported


def test_public_names_are_sorted_and_exist() -> None:
    assert hotloop_client.__all__ == sorted(hotloop_client.__all__)
    for name in hotloop_client.__all__:
        assert getattr(hotloop_client, name) is not None


def test_turn_interrupted_keeps_partial_text() -> None:
    error = TurnInterrupted("replica died", "Hello", grpc.StatusCode.INTERNAL)
    assert error.partial_text == "Hello"
    assert isinstance(error, Unavailable)
    assert "same history" in str(error)


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "", True),
        (grpc.StatusCode.INTERNAL, "ray.exceptions.ActorDiedError: ...", True),
        (grpc.StatusCode.INTERNAL, "RayActorError: The actor died", True),
        (  # a lost node (seen in bench/multinode.py)
            grpc.StatusCode.INTERNAL,
            "The actor 4db3 is unavailable: The actor is temporarily unavailable: RpcError: Socket closed",
            True,
        ),
        (  # a killed replica behind the gRPC transport (RAY_SERVE_PROXY_USE_GRPC)
            grpc.StatusCode.INTERNAL,
            "The actor 0170 is unavailable: Actor is unavailable.. "
            "The task may or may not have been executed on the actor.",
            True,
        ),
        (grpc.StatusCode.INTERNAL, "Replica r-1 is unhealthy", True),
        (grpc.StatusCode.INTERNAL, "KeyError: 'x'", False),
        (grpc.StatusCode.NOT_FOUND, "replica", False),
        (  # Ray's proxy while the model's application deploys (a server starting or restarting)
            grpc.StatusCode.NOT_FOUND,
            "Application 'm' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available "
            "applications.",
            True,
        ),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", False),
        (grpc.StatusCode.CANCELLED, "actor died", False),
    ],
)
def test_which_failures_fail_over(code: grpc.StatusCode, details: str, expected: bool) -> None:
    assert is_failover(code, details) is expected


def test_unary_retry_stops_at_max_attempts() -> None:
    exc = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "")
    assert all(should_retry_unary(exc, attempt=a) for a in range(1, MAX_ATTEMPTS))
    assert not should_retry_unary(exc, attempt=MAX_ATTEMPTS)
    assert not should_retry_unary(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, ""), attempt=1)


def test_stream_progress_retries_only_before_text() -> None:
    down = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")
    progress = StreamProgress()
    progress.delivered(Chunk(text=""))  # an empty chunk shows the caller nothing
    for _ in range(MAX_ATTEMPTS - 1):
        assert progress.should_retry(down)
    assert not progress.should_retry(down)  # MAX_ATTEMPTS attempts in all
    assert type(progress.error(down)) is Unavailable

    progress = StreamProgress()
    progress.delivered(Chunk(text="Hi"))
    progress.delivered(Chunk(text=" there"))
    assert not progress.should_retry(down)
    error = progress.error(down)
    assert isinstance(error, TurnInterrupted) and error.partial_text == "Hi there"
    # A non-failover error after text is reported as itself, not as an interruption.
    assert type(progress.error(FakeRpcError(grpc.StatusCode.OUT_OF_RANGE, "full"))) is OutOfRange


class RichRpcError(FakeRpcError):
    """Also carries the trailers, as grpc's errors do (``trailing_metadata()``)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, bytes], ...]) -> None:
        super().__init__(code, details)
        self._trailers = trailers

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailers


def _from_server(error: Exception) -> RichRpcError:
    """What a client receives for ``error``: the server's own status mapping and trailer."""
    from hotloop_serve.serve.status import DETAILS_KEY, rich_status, to_status

    code, details = to_status(error)
    return RichRpcError(code, details, ((DETAILS_KEY, rich_status(error, code, details).SerializeToString()),))


def test_rich_details_tell_retry_from_fix_without_parsing_text() -> None:
    from hotloop_serve import errors as server

    bad = from_rpc_error(_from_server(server.InvalidArgument("top_p must be in (0, 1]", field="settings.top_p")))
    assert isinstance(bad, InvalidArgument)
    assert bad.reason == "INVALID_ARGUMENT" and bad.retry_delay is None
    assert bad.field_violations == (("settings.top_p", "top_p must be in (0, 1]"),)

    gone = from_rpc_error(_from_server(server.NotFound("session 'x' not found", reason="SESSION_NOT_FOUND")))
    assert isinstance(gone, NotFound) and gone.reason == "SESSION_NOT_FOUND" and not gone.field_violations

    later = from_rpc_error(_from_server(server.Unavailable("the engine is shutting down")))
    assert isinstance(later, Unavailable) and later.retry_delay == pytest.approx(0.2)

    full = from_rpc_error(_from_server(server.ResourceExhausted("queue full", retry_after_s=1.5)))
    assert isinstance(full, ResourceExhausted) and full.retry_delay == pytest.approx(1.5)


def test_errors_without_rich_details_still_map() -> None:
    # Ray's proxy's own errors (a dead actor) carry no trailer; a mismatched trailer is ignored.
    plain = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "ActorDiedError"))
    assert plain.reason is None and plain.field_violations == () and plain.retry_delay is None
    lying = from_rpc_error(RichRpcError(grpc.StatusCode.NOT_FOUND, "x", (("grpc-status-details-bin", b"\x08\x03"),)))
    assert isinstance(lying, NotFound) and lying.reason is None


def test_retries_follow_the_servers_word_then_rays() -> None:
    from hotloop_client._base import retriable

    from hotloop_serve import errors as server

    assert retriable(_from_server(server.Unavailable("draining")))  # RetryInfo
    assert retriable(_from_server(server.ResourceExhausted("queue full", retry_after_s=1.0)))
    assert not retriable(_from_server(server.ResourceExhausted("too many sessions")))
    # Our own INTERNAL is a bug, even if its text happens to say "replica": never re-sent.
    assert not retriable(_from_server(RuntimeError("replica state corrupt")))
    # Without rich details (gRPC itself, Ray's proxy): the code and Ray's wording decide.
    assert retriable(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert retriable(FakeRpcError(grpc.StatusCode.INTERNAL, "ray.exceptions.ActorDiedError: gone"))
    assert not retriable(FakeRpcError(grpc.StatusCode.INTERNAL, "division by zero"))
