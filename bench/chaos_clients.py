"""The chaos soak's users: conversations through the Python SDK and the OpenAI HTTP API.

Each worker thread plays conversation after conversation, greedy, every turn logged with the
exact history it answered (``TurnLog``), so that afterwards each reply can be compared with
the same history computed alone. Users misbehave the way real ones do: they cancel a stream
after its first chunk and send the turn again, read slowly, drop the HTTP connection
mid-stream, fork a session or move it by export and import between turns.

A failed attempt is classified at once: a documented retryable status (the server said
"again later": ``UNAVAILABLE`` and its ``TurnInterrupted``, ``RESOURCE_EXHAUSTED``, a session
still busy with the call we just cancelled; HTTP 429/503 or a refused connection while the
server restarts) is retried with backoff until the turn's budget runs out; anything else
(``INTERNAL``, ``NOT_FOUND``, a deadline passed, HTTP 500) is a violation and ends the
conversation. A turn is lost when it never completed.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx2
from hotloop_client._base import is_failover

History = tuple[tuple[str, str], ...]

RETRYABLE_GRPC = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"}
"""Statuses a client is told to retry (docs/reliability.md). FAILED_PRECONDITION is "the session
is busy": the call a client just cancelled may still be ending on the replica."""
RETRYABLE_HTTP = {409, 429, 503}
RAY_ROUTE_NOT_FOUND = "not found. Ping http"
"""Ray's HTTP proxy's 404 for a route no application serves yet: while a whole server starts,
its port opens seconds before the model's routes exist (docs/reliability.md, "Faults")."""

RAY_APP_NOT_FOUND = "not found. Ping /ray.serve.RayServeAPIService/ListApplications"
"""Ray's gRPC proxy's NOT_FOUND for an application not deployed yet: the gRPC twin of the 404
above. The SDKs retry it like a failover, but a whole-server restart (~20-25 s here) outlasts
their few seconds of retries, so it can reach the caller: documented as "retry later"."""


def grpc_retry_cause(code: str, text: str) -> str | None:
    """Why a failed gRPC attempt may be retried, or None if it is a violation."""
    if code in RETRYABLE_GRPC:
        return code
    if code == "NOT_FOUND" and RAY_APP_NOT_FOUND in text:
        return "NOT_FOUND from Ray's proxy (the server is starting)"
    return None


_WORD_TEXT = (
    "river stone lantern harbor meadow copper signal orbit garden ledger winter canyon archive compass "
    "thunder pepper violet engine marble falcon quartz saddle timber glacier beacon velvet cipher island "
    "orchard rocket tunnel bramble prairie anchor"
)
_WORDS = _WORD_TEXT.split()
_ASKS = (
    "Summarize the notes above in one sentence.",
    "Which item in my notes matters most, and why?",
    "Give one question these notes leave open.",
    "Rewrite the last point for a child.",
    "Name two items from the notes that belong together.",
)


def user_text(rng: random.Random, words: int) -> str:
    notes = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Notes: {notes}. {rng.choice(_ASKS)}"


@dataclass
class TurnLog:
    """One user turn as the client lived it: every attempt, and the reply that completed it."""

    conversation: str
    api: str
    """``sdk``, ``http`` or ``fill`` (a long first turn sent to drive the KV pool full)."""
    history: History
    t_start: float
    reply: str | None = None
    ttft_s: float | None = None
    t_end: float | None = None
    attempts: int = 0
    retried: list[str] = field(default_factory=list)
    """Why each attempt before the last one failed (a status name, ``client-cancel``, ...)."""
    violation: str = ""
    """Set when an attempt failed with an undocumented status or the turn hung: the turn is lost."""
    behaviour: str = ""
    via: str = ""
    """How this conversation's session got here: ``fork`` or ``import`` (else empty)."""

    @property
    def lost(self) -> bool:
        return self.reply is None


@dataclass
class LoadContext:
    address: str
    http_base: str
    model: str
    reply_tokens: int
    turns: int
    user_words: tuple[int, int]
    turn_budget_s: float
    attempt_timeout_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    logs: list[TurnLog] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    t0: float = field(default_factory=time.monotonic)
    ops: dict[str, int] = field(default_factory=dict)
    """Counts of session operations done between turns (fork, export/import) and their failures."""

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, log: TurnLog) -> None:
        with self.lock:
            self.logs.append(log)

    def count(self, op: str) -> None:
        with self.lock:
            self.ops[op] = self.ops.get(op, 0) + 1


class Retry(Exception):
    """An attempt failed in a documented, retryable way."""


class Violation(Exception):
    """An attempt failed in a way no client is told to expect."""


def _grpc_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if isinstance(code, grpc.StatusCode):
        return code.name
    if callable(code):
        with contextlib.suppress(Exception):
            c = code()
            if isinstance(c, grpc.StatusCode):
                return c.name
    return type(exc).__name__


def run_turn(ctx: LoadContext, log: TurnLog, attempt: Callable[[TurnLog, int], tuple[str, float]]) -> None:
    """Attempts until one completes, a violation, or the turn's budget is spent."""
    began = time.monotonic()
    deadline = began + ctx.turn_budget_s
    backoff = 0.2
    while True:
        log.attempts += 1
        sent = time.monotonic()
        try:
            text, ttft = attempt(log, log.attempts)
            # What the user waited: from the turn's first send to the first text it kept.
            log.reply, log.ttft_s, log.t_end = text, sent - began + ttft, ctx.now()
            return
        except Retry as exc:
            log.retried.append(str(exc))
        except Violation as exc:
            log.violation = str(exc)
            log.t_end = ctx.now()
            return
        if time.monotonic() + backoff > deadline:
            log.violation = f"not completed in {ctx.turn_budget_s:.0f} s ({len(log.retried)} retries)"
            log.t_end = ctx.now()
            return
        time.sleep(backoff)
        backoff = min(backoff * 1.6, 3.0)


# ---------------------------------------------------------------------------------------
# The Python SDK
# ---------------------------------------------------------------------------------------


class SdkWorker(threading.Thread):
    """Conversations through ``hotloop_client``: one session each, forked or moved between turns."""

    def __init__(self, ctx: LoadContext, client: Any, name: str, seed: int, *, api: str = "sdk") -> None:
        super().__init__(name=name, daemon=True)
        self.ctx, self.client, self.rng, self.api = ctx, client, random.Random(seed), api
        self.conversations = 0

    def settings(self) -> Any:
        from hotloop_client import Settings

        return Settings(temperature=0, sample_len=self.ctx.reply_tokens, repeat_penalty=1.0, seed=7)

    def run(self) -> None:
        while not self.ctx.stop.is_set():
            self.conversation(self.ctx.turns)

    def _with_retries(self, what: str, fn: Callable[[], Any]) -> Any:
        """A control RPC (create, fork, export, import, close), retried while the fleet changes."""
        deadline = time.monotonic() + self.ctx.turn_budget_s
        while True:
            try:
                return fn()
            except Exception as exc:
                code = _grpc_code(exc)
                if grpc_retry_cause(code, str(exc)) is None or time.monotonic() > deadline:
                    self.ctx.count(f"{what} failed: {code}: {str(exc)[:160]}")
                    raise
            time.sleep(0.5)

    def conversation(self, turns: int, first_words: int | None = None) -> None:
        self.conversations += 1
        cid = f"{self.name}.{self.conversations}"
        model = self.client.model(self.ctx.model)
        try:
            session = self._with_retries("create", lambda: model.new_session(settings=self.settings()))
        except Exception:
            return
        history: list[tuple[str, str]] = []
        via = ""
        try:
            for turn in range(turns):
                if self.ctx.stop.is_set():
                    return
                words = first_words if (first_words and turn == 0) else self.rng.randint(*self.ctx.user_words)
                history.append(("user", user_text(self.rng, words)))
                log = TurnLog(cid, self.api, tuple(history), self.ctx.now(), via=via)
                behaviour = self.rng.random()
                log.behaviour = "cancel" if behaviour < 0.06 else "slow" if behaviour < 0.14 else ""
                run_turn(self.ctx, log, lambda lg, n, s=session: self._attempt(s, lg, n))
                self.ctx.record(log)
                if log.reply is None:
                    return
                history.append(("assistant", log.reply))
                session, via = self._maybe_move(model, session, via)
        finally:
            with contextlib.suppress(Exception):
                self._with_retries("close", lambda: session.close(timeout=30))

    def _attempt(self, session: Any, log: TurnLog, n: int) -> tuple[str, float]:
        from hotloop_client import HotloopError, Message, Role, TurnInterrupted

        msgs = [Message(Role.USER if r == "user" else Role.ASSISTANT, c) for r, c in log.history]
        t0 = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        gen = session.generate(msgs, timeout=self.ctx.attempt_timeout_s)
        try:
            for chunk in gen:
                if chunk.text:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    parts.append(chunk.text)
                    if log.behaviour == "cancel" and n == 1:
                        gen.close()  # the SDK cancels the call on the server
                        raise Retry("client-cancel")
                    if log.behaviour == "slow":
                        time.sleep(0.05)
        except TurnInterrupted as exc:  # the SDK's documented "retry the turn", whatever Ray's code
            raise Retry("TurnInterrupted") from exc
        except HotloopError as exc:
            code = exc.code.name if isinstance(exc.code, grpc.StatusCode) else str(exc.code)
            cause = grpc_retry_cause(code, str(getattr(exc, "details", "")) or str(exc))
            if cause is not None:
                raise Retry(cause) from exc
            raise Violation(f"{code}: {exc.details[:200] if hasattr(exc, 'details') else exc}") from exc
        finally:
            gen.close()
        return "".join(parts), ttft if ttft is not None else time.monotonic() - t0

    def _maybe_move(self, model: Any, session: Any, via: str) -> tuple[Any, str]:
        """Between turns, sometimes continue on a fork or on an exported-and-imported copy."""
        roll = self.rng.random()
        try:
            if roll < 0.08:
                new = self._with_retries("fork", lambda: session.fork(timeout=60))
                self.ctx.count("fork")
                moved = "fork"
            elif roll < 0.16:
                blob = self._with_retries("export", lambda: session.export(timeout=60))
                new = self._with_retries(
                    "import", lambda: model.import_session(blob, settings=self.settings(), timeout=60)
                )
                self.ctx.count("export+import")
                moved = "import"
            else:
                return session, via
        except Exception:
            return session, via  # counted by _with_retries; the conversation goes on where it was
        with contextlib.suppress(Exception):
            session.close(timeout=30)
        return new, moved


# ---------------------------------------------------------------------------------------
# The OpenAI HTTP API, through the `openai` package
# ---------------------------------------------------------------------------------------


class HttpWorker(threading.Thread):
    """Chat completions with the whole history resent each turn, streamed, one conversation
    key (``X-Session-Id``) per conversation."""

    def __init__(self, ctx: LoadContext, name: str, seed: int) -> None:
        super().__init__(name=name, daemon=True)
        import openai

        self.ctx, self.rng = ctx, random.Random(seed)
        self.client = openai.OpenAI(
            base_url=ctx.http_base, api_key="none", max_retries=0, timeout=ctx.attempt_timeout_s
        )
        self.conversations = 0

    def run(self) -> None:
        while not self.ctx.stop.is_set():
            self.conversation()

    def conversation(self) -> None:
        self.conversations += 1
        cid = f"{self.name}.{self.conversations}"
        history: list[tuple[str, str]] = []
        for _turn in range(self.ctx.turns):
            if self.ctx.stop.is_set():
                return
            history.append(("user", user_text(self.rng, self.rng.randint(*self.ctx.user_words))))
            log = TurnLog(cid, "http", tuple(history), self.ctx.now())
            behaviour = self.rng.random()
            log.behaviour = "disconnect" if behaviour < 0.06 else "slow" if behaviour < 0.14 else ""
            run_turn(self.ctx, log, lambda lg, n, c=cid: self._attempt(c, lg, n))
            self.ctx.record(log)
            if log.reply is None:
                return
            history.append(("assistant", log.reply))

    def _attempt(self, cid: str, log: TurnLog, n: int) -> tuple[str, float]:
        import openai

        t0 = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        try:
            stream = self.client.chat.completions.create(
                model=self.ctx.model,
                messages=[{"role": r, "content": c} for r, c in log.history],  # type: ignore[misc]
                temperature=0,
                max_tokens=self.ctx.reply_tokens,
                seed=7,
                stream=True,
                extra_body={"repeat_penalty": 1.0},
                extra_headers={"X-Session-Id": cid},
            )
            with contextlib.closing(stream):
                for event in _events(stream):
                    text = event.choices[0].delta.content if event.choices else None
                    if text:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        parts.append(text)
                        if log.behaviour == "disconnect" and n == 1:
                            raise Retry("client-disconnect")  # closing() drops the connection
                        if log.behaviour == "slow":
                            time.sleep(0.05)
        except openai.APIStatusError as exc:
            if exc.status_code in RETRYABLE_HTTP:
                raise Retry(f"HTTP {exc.status_code}") from exc
            if exc.status_code == 404 and RAY_ROUTE_NOT_FOUND in exc.response.text:
                raise Retry("HTTP 404 from Ray's proxy (the server is starting)") from exc
            if exc.status_code == 500 and _from_rays_proxy(exc):
                raise Retry("HTTP 500 from Ray's proxy (the receiving replica died)") from exc
            raise Violation(f"HTTP {exc.status_code}: {exc.response.text[:200]}") from exc
        except openai.APITimeoutError as exc:
            raise Violation(f"no answer in {self.ctx.attempt_timeout_s:.0f} s") from exc
        except openai.APIConnectionError as exc:
            raise Retry("connection refused or dropped") from exc
        except openai.APIError as exc:  # an {"error": ...} event after the stream started
            if _retryable_event(exc.body):
                raise Retry(f"error event: {exc.message[:80]}") from exc
            raise Violation(f"error event: {exc.message[:200]}") from exc
        except httpx2.HTTPError as exc:  # the connection broke mid-stream (a replica or proxy died)
            raise Retry(f"stream broken: {type(exc).__name__}") from exc
        return "".join(parts), ttft if ttft is not None else time.monotonic() - t0


def _events(stream: Any) -> Iterator[Any]:
    yield from stream


def _from_rays_proxy(exc: Any) -> bool:
    """A 500 of Ray's HTTP proxy, not of ours: the replica that received the request died under
    it (plain text ``Internal Server Error``, or Ray's actor-died text). hotloop-serve's own
    errors are OpenAI-style JSON bodies (``{"error": {...}}``)."""
    text = exc.response.text
    return text.strip() == "Internal Server Error" or is_failover(grpc.StatusCode.INTERNAL, text)


def _retryable_event(body: object) -> bool:
    """An error event is retryable when it carries the server's retry advice: a 429/503 body
    (``rate_limit_error``, or a ``server_error`` whose message says to retry the turn)."""
    if not isinstance(body, dict):
        return False
    err = body.get("error", body)
    if not isinstance(err, dict):
        return False
    kind, message = str(err.get("type", "")), str(err.get("message", "")).lower()
    return kind == "rate_limit_error" or (kind == "server_error" and "retry" in message)


class ResponsesWorker(HttpWorker):
    """The stateful Responses API: each turn sends only the new user message and the previous
    response's id; the server holds the conversation (its owner's hot session). The history
    logged for the reference is the conversation that id stands for."""

    def conversation(self) -> None:
        self.conversations += 1
        cid = f"{self.name}.{self.conversations}"
        history: list[tuple[str, str]] = []
        previous: str | None = None
        for _turn in range(self.ctx.turns):
            if self.ctx.stop.is_set():
                return
            history.append(("user", user_text(self.rng, self.rng.randint(*self.ctx.user_words))))
            log = TurnLog(cid, "responses", tuple(history), self.ctx.now())
            log.behaviour = "slow" if self.rng.random() < 0.1 else ""
            ids: list[str] = []
            run_turn(self.ctx, log, lambda lg, n, p=previous, out=ids: self._respond(p, lg, out))
            self.ctx.record(log)
            if log.reply is None:
                return
            history.append(("assistant", log.reply))
            previous = ids[-1]

    def _respond(self, previous: str | None, log: TurnLog, ids: list[str]) -> tuple[str, float]:
        import openai

        t0 = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        try:
            stream = self.client.responses.create(
                model=self.ctx.model,
                input=log.history[-1][1],
                previous_response_id=previous,
                store=True,
                temperature=0,
                max_output_tokens=self.ctx.reply_tokens,
                stream=True,
                extra_body={"repeat_penalty": 1.0},
            )
            with contextlib.closing(stream):
                for event in _events(stream):
                    kind = getattr(event, "type", "")
                    if kind == "response.output_text.delta":
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        parts.append(event.delta)
                        if log.behaviour == "slow":
                            time.sleep(0.05)
                    elif kind in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                        ids.append(event.response.id)
                    elif kind == "error":
                        code = str(getattr(event, "code", ""))
                        if code in RETRYABLE_GRPC:
                            raise Retry(f"error event {code}")
                        raise Violation(f"error event {code}: {getattr(event, 'message', '')[:160]}")
        except openai.APIStatusError as exc:
            if exc.status_code in RETRYABLE_HTTP:
                raise Retry(f"HTTP {exc.status_code}") from exc
            if exc.status_code == 404 and RAY_ROUTE_NOT_FOUND in exc.response.text:
                raise Retry("HTTP 404 from Ray's proxy (the server is starting)") from exc
            if exc.status_code == 500 and _from_rays_proxy(exc):
                raise Retry("HTTP 500 from Ray's proxy (the receiving replica died)") from exc
            raise Violation(f"HTTP {exc.status_code}: {exc.response.text[:200]}") from exc
        except openai.APITimeoutError as exc:
            raise Violation(f"no answer in {self.ctx.attempt_timeout_s:.0f} s") from exc
        except openai.APIConnectionError as exc:
            raise Retry("connection refused or dropped") from exc
        except httpx2.HTTPError as exc:
            raise Retry(f"stream broken: {type(exc).__name__}") from exc
        if not ids:
            raise Violation("the stream ended without response.completed or response.incomplete")
        return "".join(parts), ttft if ttft is not None else time.monotonic() - t0
