"""The output stage: a request's row of logits in, an :class:`Outcome` out (after vLLM's output processor).

It samples the token, turns it into text that is safe to stream (whole UTF-8 characters, stop
sequences held back) and says whether the reply ended on its own (end of generation, a stop
sequence). It returns that outcome and changes nothing but the request's output progress
(its sampler, text assembler, token count, first-token time): putting text on the stream
and ending the request are the scheduler's (:meth:`Scheduler.update_from_output`), which
also applies the limits that depend on the cache (``sample_len``, the session's window).

:func:`final_chunk` builds a request's last chunk (the rest of its text, usage, timings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hotloop_serve.engine.stream import Chunk, Timings, TokenLogprob

if TYPE_CHECKING:
    import llama_cpp as ll

    from hotloop_serve.engine.model import Model
    from hotloop_serve.engine.requests import Request
    from hotloop_serve.engine.runner import Logits


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one sampled token did to its reply."""

    token: int
    text: str
    """Text to stream now (may be empty: held back for a stop sequence or a split character)."""
    logprobs: list[TokenLogprob] | None
    finish: str | None = None
    """``"eos"`` or ``"stop"`` when the reply ended with this token, else None."""


class OutputProcessor:
    """Samples and detokenizes on the scheduler thread (the samplers read the context's logits)."""

    def __init__(self, model: Model, ctx: ll.llama_context_p | None) -> None:
        self.model = model
        self.ctx = ctx

    def process(self, req: Request, logits: Logits) -> Outcome:
        assert req.sampler is not None
        if req.generated == 0:
            req.t_first = time.perf_counter()
        token = req.sampler.sample(self.ctx, logits.index, logits.row)
        if self.model.is_eog(token):
            return Outcome(token, "", None, "eos")
        req.generated += 1
        if req.settings.logprobs:
            req.sampler.record_logprob(self.ctx, logits.index, token, self.model.piece, logits.row)
        text = req.assembler.feed(self.model.piece(token))
        logprobs = req.sampler.take_logprobs() if text else None
        return Outcome(token, text, logprobs, "stop" if req.assembler.stopped else None)


def final_chunk(req: Request, reason: str) -> Chunk:
    """The request's last chunk: text still held back, usage, timings, the logprobs not yet sent."""
    text = "" if req.assembler.stopped else req.assembler.flush()
    end = time.perf_counter()
    req.usage.completion_tokens = req.generated
    t0 = req.t_admit or req.t_submit
    first = req.t_first or end
    timings = Timings(
        queue_ms=(t0 - req.t_submit) * 1e3,
        prefill_ms=(first - t0) * 1e3,
        time_to_first_token_ms=(first - req.t_submit) * 1e3,
        decode_ms=(end - first) * 1e3 if req.t_first else 0.0,
    )
    hit = req.usage.cached_tokens + req.usage.restored_tokens > 0
    logprobs = req.sampler.take_logprobs() if req.sampler is not None else None
    return Chunk(text, reason, req.usage, timings, cache_hit=hit, logprobs=logprobs)
