"""The blocking client: ``Client`` -> ``Model`` -> ``Session``.

Every method here is the I/O half of a pair: the request building, metadata, retry rules
and conversions are in ``_base.py`` and shared with ``_async_client.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any

import grpc
from hotloop.v1 import model_pb2_grpc, session_pb2, session_pb2_grpc

from . import _base
from ._base import HistoryLike
from ._errors import HotloopError, NotFound, from_rpc_error
from ._types import Chunk, ModelInfo, SessionInfo, Settings, Usage


class Client:
    """A connection to a hotloop-serve deployment (Ray Serve's gRPC proxy).

    ``address`` is ``host:port``. ``token`` is sent as ``authorization: Bearer``; ``tls`` or
    ``root_certificates`` (PEM bytes) switch to TLS. ``timeout`` is the default deadline, in
    seconds, of every call, including a whole streamed reply; each method's ``timeout=``
    overrides it. ``retry_delay`` is the pause before the one automatic retry after a
    replica failure. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        retry_delay: float = 0.1,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._base = _base.BaseClient(
            address,
            token=token,
            tls=tls,
            root_certificates=root_certificates,
            timeout=timeout,
            retry_delay=retry_delay,
            options=options,
        )
        credentials = self._base.credentials
        if credentials is None:
            self._channel: Any = grpc.insecure_channel(address, options=self._base.options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=self._base.options)
        self._sessions = session_pb2_grpc.SessionServiceStub(self._channel)
        self._models = model_pb2_grpc.ModelServiceStub(self._channel)
        self._list_applications = self._channel.unary_unary(
            _base.LIST_APPLICATIONS_METHOD,
            request_serializer=_base.encode_empty,
            response_deserializer=_base.decode_application_names,
        )

    # -- plumbing ---------------------------------------------------------------------

    def _unary(self, method: Callable[..., Any], request: Any, application: str | None, timeout: float | None) -> Any:
        """One unary call, retried once after a replica failure, errors translated."""
        deadline = self._base.deadline(timeout)
        attempt = 1
        while True:
            try:
                return method(request, metadata=self._base.metadata(application), timeout=deadline.remaining())
            except grpc.RpcError as exc:
                if not _base.should_retry_unary(exc, attempt):
                    raise from_rpc_error(exc) from exc
            attempt += 1
            time.sleep(self._base.retry_delay)

    # -- public API -------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._base.address

    def application_names(self, *, timeout: float | None = None) -> list[str]:
        """The Ray Serve applications behind the proxy (one per served model)."""
        names: list[str] = self._unary(self._list_applications, b"", None, timeout)
        return names

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """Every model the server serves.

        No model name is known yet, so the proxy's own ListApplications names an app to
        route ListModels to. A server that is not behind Ray Serve (UNIMPLEMENTED) is asked
        directly.
        """
        application: str | None = None
        try:
            names = self.application_names(timeout=timeout)
        except HotloopError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
        else:
            if not names:
                return []
            application = names[0]
        response = self._unary(self._models.ListModels, _base.list_models_request(), application, timeout)
        return [_base.model_info_from_proto(m) for m in response.models]

    def model(self, name: str) -> Model:
        """A handle on one served model (no call is made until you use it)."""
        return Model(self, name)

    def close(self) -> None:
        """Close the channel; sessions are not closed on the server (they expire there)."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Client {self._base.describe()}>"


class Model:
    """One served model; every call it makes is routed to the Ray Serve app of that name."""

    def __init__(self, client: Client, name: str) -> None:
        if not name:
            raise ValueError("model name is empty")
        self._client = client
        self.name = name

    def info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model's architecture, context length, quantization, replicas (GetModel)."""
        client = self._client
        pb = client._unary(client._models.GetModel, _base.get_model_request(self.name), self.name, timeout)
        return _base.model_info_from_proto(pb)

    def tokenize(self, text: str, *, add_special: bool = False, timeout: float | None = None) -> list[int]:
        """Token ids of ``text`` under the model's vocabulary."""
        client = self._client
        request = _base.tokenize_request(self.name, text, add_special)
        pb = client._unary(client._models.Tokenize, request, self.name, timeout)
        return list(pb.tokens)

    def new_session(self, settings: Settings | None = None, *, timeout: float | None = None) -> Session:
        """Create a session (a conversation whose KV cache stays hot between turns)."""
        client = self._client
        settings = settings or Settings()
        request = _base.create_session_request(self.name, settings, _base.new_session_key())
        pb = client._unary(client._sessions.CreateSession, request, self.name, timeout)
        state = _base.SessionState(id=pb.id, model=self.name, settings=settings)
        state.apply(pb, settings)
        return Session(client, state)

    def __repr__(self) -> str:
        return f"<Model {self.name!r} at {self._client.address}>"


class Session:
    """A conversation on the server. You keep the history and send all of it each turn;
    the session only makes follow-up turns fast by keeping its KV cache. Use as a context
    manager to close it."""

    def __init__(self, client: Client, state: _base.SessionState) -> None:
        self._client = client
        self._state = state

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def model(self) -> str:
        return self._state.model

    @property
    def settings(self) -> Settings:
        """The settings sent with every request of this session."""
        return self._state.settings

    def _call(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        return self._client._unary(method, request, self._state.model, timeout)

    def generate(
        self, history: HistoryLike, *, timeout: float | None = None, **overrides: Any
    ) -> Generator[Chunk, None, None]:
        """Stream the reply to ``history`` (``Message``s or ``(role, content)`` pairs).

        Keyword ``overrides`` (e.g. ``temperature=0``) apply to this turn only. If the
        replica fails before any text arrived the request is re-sent once; after text
        arrived, :class:`TurnInterrupted` carries the partial text. Breaking out of the
        loop (or closing the generator) cancels the call on the server.
        """
        request = self._state.generate_request(history, overrides)
        return self._stream(request, timeout)

    def _stream(self, request: Any, timeout: float | None) -> Generator[Chunk, None, None]:
        client = self._client
        deadline = client._base.deadline(timeout)
        progress = _base.StreamProgress()
        while True:
            call = client._sessions.Generate(
                request, metadata=client._base.metadata(self._state.model), timeout=deadline.remaining()
            )
            try:
                for pb in call:
                    chunk = _base.chunk_from_proto(pb)
                    progress.delivered(chunk)
                    yield chunk
                return
            except grpc.RpcError as exc:
                if not progress.should_retry(exc):
                    raise progress.error(exc) from exc
            finally:
                # No-op once the call finished; otherwise (break, close, Ctrl-C, error) it
                # frees the server's slot at once instead of generating into the void.
                call.cancel()
            time.sleep(client._base.retry_delay)

    def warmup(self, history: HistoryLike, *, timeout: float | None = None) -> Usage:
        """Prefill ``history`` (e.g. a system prompt) into the cache without generating."""
        pb = self._call(self._client._sessions.Warmup, self._state.warmup_request(history), timeout)
        return _base.usage_from_proto(pb.usage)

    def info(self, *, timeout: float | None = None) -> SessionInfo:
        """The server's view of the session (context tokens, state, settings)."""
        pb = self._call(self._client._sessions.GetSession, session_pb2.GetSessionRequest(session_id=self.id), timeout)
        return _base.session_info_from_proto(pb)

    def context(self, *, timeout: float | None = None) -> int:
        """Tokens held in the session's KV cache on the server."""
        return self.info(timeout=timeout).context_tokens

    def set_settings(self, settings: Settings, *, timeout: float | None = None) -> Settings:
        """Replace the session's settings (unset fields take the server's defaults)."""
        request = session_pb2.UpdateSettingsRequest(session_id=self.id, settings=_base.settings_to_proto(settings))
        pb = self._call(self._client._sessions.UpdateSettings, request, timeout)
        self._state.apply(pb, settings)
        return self._state.settings

    def clear_cache(self, *, timeout: float | None = None) -> None:
        """Drop the session's KV cache; the next turn prefills its history from scratch."""
        self._call(self._client._sessions.ClearCache, session_pb2.ClearCacheRequest(session_id=self.id), timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Free the session on the server. Idempotent; a session already gone is fine."""
        if self._state.closed:
            return
        with contextlib.suppress(NotFound):  # the server forgot it already: closed is closed
            request = session_pb2.CloseSessionRequest(session_id=self.id)
            self._call(self._client._sessions.CloseSession, request, timeout)
        self._state.closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._state)
