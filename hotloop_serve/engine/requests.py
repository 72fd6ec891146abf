"""A request's life as an explicit state machine (after vLLM's ``RequestStatus`` and llama.cpp's slots).

::

    WAITING ──admit──> PREFILLING ──last prompt token──> DECODING ──end──> CACHING_TAIL ──step──> FINISHED
       │                  │   ▲                            │   ▲                 │
       │                  │   └────── resume ───────┐      │   │                 │
       │                  └───────> PREEMPTED <─────┼──────┘   │                 │
       │                               └── resume ──┴──────────┘                 │
       └──────────── any live state ──> CANCELLED | FAILED | FINISHED <──────────┘

A warmup request goes PREFILLING -> FINISHED. ``CACHING_TAIL`` is a reply whose final chunk
was sent but whose last sampled token still needs one decode step to enter the cache (so the
next turn reuses it). ``PREEMPTED`` is a running request whose KV was saved to host RAM to
free cells for others; it resumes exactly where it was.

:meth:`Request.transition` is the only way to change state: it checks the move is legal
frees what the new state no longer needs: the sampler once nothing more is sampled, the
session once the request ends, so no resource outlives its request whatever path ended it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hotloop_serve.engine.sampling import Sampler, TextAssembler
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import RequestStream, Usage

if TYPE_CHECKING:
    from hotloop_serve.engine.session import KVBytes, Session


class RequestKind(enum.Enum):
    GENERATE = "generate"
    WARMUP = "warmup"


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    CACHING_TAIL = "caching_tail"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def running(self) -> bool:
        """Holds a sequence and takes part in steps."""
        return self in _RUNNING


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED})
_RUNNING = frozenset({RequestState.PREFILLING, RequestState.DECODING, RequestState.CACHING_TAIL})
_ENDS = _TERMINAL
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.PREFILLING}) | _ENDS,
    RequestState.PREFILLING: frozenset({RequestState.DECODING, RequestState.CACHING_TAIL, RequestState.PREEMPTED})
    | _ENDS,
    RequestState.DECODING: frozenset({RequestState.CACHING_TAIL, RequestState.PREEMPTED}) | _ENDS,
    RequestState.CACHING_TAIL: _ENDS,
    RequestState.PREEMPTED: frozenset({RequestState.PREFILLING, RequestState.DECODING}) | _ENDS,
}


class IllegalTransition(RuntimeError):
    """A bug: the engine tried a move the state machine does not allow."""


class Request:
    """One Generate or Warmup of a session: its prompt, sampler, progress and stream."""

    __slots__ = (
        "assembler",
        "cancel_requested",
        "cost",
        "disk",
        "generated",
        "kind",
        "last_token",
        "order",
        "prompt",
        "resume_token",
        "sampler",
        "session",
        "settings",
        "state",
        "stream",
        "t_admit",
        "t_first",
        "t_submit",
        "usage",
    )

    def __init__(
        self,
        kind: RequestKind,
        session: Session,
        prompt: list[int],
        settings: SamplingSettings,
        wake: Callable[[], None],
        order: int = 0,
    ) -> None:
        self.kind = kind
        self.session = session
        self.prompt = prompt
        """Tokens that must be in the cache before the request decodes (the rendered history)."""
        self.settings = settings
        self.state = RequestState.WAITING
        self.order = order
        """Submission order: the scheduler admits oldest first and pre-empts newest first."""
        self.cancel_requested = False

        def cancel() -> None:
            self.cancel_requested = True
            wake()

        self.stream = RequestStream(cancel)
        self.sampler: Sampler | None = None
        self.assembler = TextAssembler(settings.stop)
        self.usage = Usage(prompt_tokens=len(prompt))
        self.generated = 0
        self.last_token: int | None = None
        """The sampled token to decode next (DECODING, CACHING_TAIL)."""
        self.disk: tuple[list[int], KVBytes] | None = None
        """A persisted cache of the session (tokens, KV) to restore at admission, read off-thread."""
        self.resume_token: int | None = None
        """A pre-empted reply whose KV could not be restored re-prefills its tokens, then decodes this."""
        self.cost = len(prompt)
        """Estimated prompt tokens to compute at admission (set by the scheduler as it queues the
        request: what the session's cache does not hold): the admission order's main key."""
        self.t_submit = time.perf_counter()
        self.t_admit = 0.0
        self.t_first = 0.0

    # -- the state machine --
    def transition(self, new: RequestState) -> None:
        """Move to ``new``; terminal states free the sampler and release the session."""
        if new not in _ALLOWED.get(self.state, frozenset()):
            raise IllegalTransition(f"request of session {self.session.id}: {self.state.name} -> {new.name}")
        self.state = new
        if (new.terminal or new is RequestState.CACHING_TAIL) and self.sampler is not None:
            self.sampler.free()  # nothing more to sample
            self.sampler = None
        if new.terminal:
            s = self.session
            if s.request is self:
                s.request = None
            s.last_used = time.monotonic()

    # -- what the batch planner reads (``scheduler.Schedulable``) --
    @property
    def decoding(self) -> bool:
        return self.state is RequestState.DECODING or self.state is RequestState.CACHING_TAIL

    @property
    def needs_logits(self) -> bool:
        return self.kind is RequestKind.GENERATE and self.resume_token is None

    @property
    def prefill_remaining(self) -> int:
        if self.state is not RequestState.PREFILLING:
            return 0
        return len(self.prompt) - len(self.session.tokens)

    @property
    def prefill_total(self) -> int:
        """Prompt tokens this request had to prefill when it started (what is not cached)."""
        return max(self.usage.prefilled_tokens, self.prefill_remaining)

    @property
    def live(self) -> bool:
        return not self.state.terminal
