"""Per-request sampling (llama.cpp's sampler chain) and the text a request streams out.

``Sampler`` owns one llama.cpp sampler chain built from a session's settings: penalties,
top-k, top-p, min-p, temperature, then a seeded draw (or greedy at temperature 0); with a
grammar (structured output), llama.cpp's grammar sampler constrains the draw
(``_sample_constrained``). The chain is handed only the candidates that can decide the draw
(``decisive_k``), not the whole vocabulary. The draw's RNG lives in the chain, so a fixed seed reproduces
a reply whatever else shares the batch. A request that asked for logprobs also gets each
sampled token's log-probability from the row's logits (numpy, only for those requests).

``TextAssembler`` turns sampled tokens into safe text: it never emits half of a UTF-8
character split across tokens, and it holds back text that might be the start of a stop
sequence until it knows.
"""

from __future__ import annotations

import codecs
import ctypes
import functools
import math
import random
from collections.abc import Callable, Sequence

import llama_cpp as ll
import numpy as np

from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import TokenLogprob
from hotloop_serve.errors import InvalidArgument

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""llama.cpp's ``llama_token_data``, as a numpy record."""
_RANDOM_SEED_SENTINEL = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: "draw a random seed"


def fold_seed(seed: int) -> int:
    """A 64-bit user seed folded to llama.cpp's 32 bits, every bit mattering, never its random sentinel."""
    folded = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return 0x9E3779B9 if folded == _RANDOM_SEED_SENTINEL else folded


@functools.lru_cache(maxsize=4)
def _token_ids(n_vocab: int) -> np.ndarray:
    return np.arange(n_vocab, dtype=np.int32)


def prefilter_k(settings: SamplingSettings) -> int:
    """Width of a top-k cut placed before the penalties that leaves the result unchanged (0: none).

    The penalties sampler scans every candidate (262,144 for Gemma) each step; llama.h advises
    cutting first. A penalty >= 1 only lowers the logits of at most ``repeat_last_n`` tokens,
    so the final top ``k`` after penalties always lie within the original top ``k +
    repeat_last_n``: cutting there first is exact. Greedy is top-1 of the same argument. A
    penalty < 1 raises tokens, and top_k 0 keeps the whole tail for top_p/min_p: no cut there.
    """
    if settings.repeat_penalty < 1.0:
        return 0
    k = 1 if settings.greedy else settings.top_k
    return k + settings.repeat_last_n if k > 0 else 0


def decisive_k(settings: SamplingSettings) -> int:
    """How many of the highest logits decide the draw exactly (0: all of them can).

    ``llama_sampler_sample`` copies the whole vocabulary (262,144 candidates for Gemma) into a
    candidate array before the chain runs: more than the rest of a token's Python work, and it
    holds a core while the batch's other rows wait. But a chain that begins with a top-k cut
    (greedy is top-1; the penalties' prefilter, :func:`prefilter_k`, is one) sees only the top
    ``k`` candidates whatever else the array holds, so the chain given every candidate above a
    threshold that keeps at least ``k`` of them draws the same token, from the same RNG state.
    Without such a cut (top_k 0, or a penalty < 1 that can lift any token into the top) top-p
    and the draw's softmax need the whole tail: 0.
    """
    k = 1 if settings.greedy else settings.top_k
    if k <= 0:
        return 0
    if settings.repeat_penalty != 1.0 and settings.repeat_last_n > 0:
        return prefilter_k(settings)
    return k


_FIRST_MARGIN = 8.0
"""Logit distance below the best candidate of the first threshold tried (it widens until at
least ``decisive_k`` candidates lie above it); Gemma's top 40 usually lie within it (a few
hundred candidates)."""


def top_candidates(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Ids of every logit within a margin of the best, the margin widened until there are at
    least ``k`` (so they include the top ``k``, ties at the edge too); None when the row has
    no finite best or fewer than ``k`` candidates near it (the caller samples the whole row)."""
    best = float(logits.max())
    if not math.isfinite(best):
        return None
    margin = _FIRST_MARGIN
    while margin < 1e6:
        ids = np.flatnonzero(logits >= best - margin)
        if len(ids) >= k:
            return ids
        margin *= 1.5  # Gemma's logits are soft-capped: all of them lie within ~60 of the best
    return None


class Sampler:
    """A llama.cpp sampler chain for one request; free() it when the request ends.

    Repeat penalty semantics follow hot-loop: the window covers the reply being generated, not
    the history (a history always ends in an end-of-turn token, which must stay likely), and an
    end-of-generation token ends the reply before it could ever be penalized.
    """

    __slots__ = ("_argmax", "_chain", "_decisive", "_grammar", "_logprobs", "_n_vocab", "_top")

    def __init__(
        self, settings: SamplingSettings, n_vocab: int, rng: random.Random, vocab: ll.llama_vocab_p | None = None
    ) -> None:
        seed = settings.seed if settings.seed is not None else rng.getrandbits(64)
        self._n_vocab = n_vocab
        self._logprobs: list[TokenLogprob] | None = [] if settings.logprobs else None
        self._top = settings.top_logprobs
        grammar = settings.effective_grammar
        self._grammar = None
        if grammar:
            self._grammar = ll.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not self._grammar:
                self._grammar = None
                raise InvalidArgument("grammar could not be loaded by llama.cpp (see the server log)")
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = ll.llama_sampler_chain_add
        penalized = settings.repeat_penalty != 1.0 and settings.repeat_last_n > 0
        self._decisive = decisive_k(settings)
        self._argmax = settings.greedy and not penalized
        """The chain is llama.cpp's greedy sampler alone (stateless, the first best logit): an argmax."""
        if penalized:
            k = prefilter_k(settings)
            if 0 < k < n_vocab:
                add(chain, ll.llama_sampler_init_top_k(k))
            penalties = ll.llama_sampler_init_penalties(n_vocab, settings.repeat_last_n, settings.repeat_penalty, 0, 0)
            add(chain, penalties)
        if settings.greedy:
            add(chain, ll.llama_sampler_init_greedy())
        else:
            if settings.top_k > 0:
                add(chain, ll.llama_sampler_init_top_k(settings.top_k))
            if settings.top_p < 1.0:
                add(chain, ll.llama_sampler_init_top_p(settings.top_p, 1))
            if settings.min_p > 0.0:
                add(chain, ll.llama_sampler_init_min_p(settings.min_p, 1))
            add(chain, ll.llama_sampler_init_temp(settings.temperature))
            add(chain, ll.llama_sampler_init_dist(fold_seed(seed)))
        self._chain = chain

    def sample(self, ctx: ll.llama_context_p, output_index: int, logits: np.ndarray | None = None) -> int:
        """Sample (and accept) a token from the logits at ``output_index`` of the last decode
        (``logits``: that row, when the caller holds it already). An ``output_index`` below 0
        says the row is no longer in the context (a deterministic step runs several decodes,
        ``runner.py``): everything is then read from ``logits``."""
        if self._grammar is not None:
            return self._sample_constrained(ctx, output_index, logits)
        if self._decisive:
            if logits is None:
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, output_index), shape=(self._n_vocab,))
            if self._argmax:
                return int(logits.argmax())  # llama.cpp's greedy keeps the first best, as argmax does
            ids = top_candidates(logits, self._decisive)
            if ids is not None:
                return self._sample_among(ids, logits)
        if output_index < 0:
            assert logits is not None
            return self._sample_among(_token_ids(self._n_vocab), logits)
        return int(ll.llama_sampler_sample(self._chain, ctx, output_index))

    def _sample_among(self, ids: np.ndarray, logits: np.ndarray) -> int:
        """Run the chain over the candidates ``ids`` (in vocabulary order, as llama.cpp builds
        them) and accept its draw: what ``llama_sampler_sample`` does over the whole row."""
        data = np.empty(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        data["logit"] = logits[ids]
        data["p"] = 0.0
        cur = ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=len(ids), selected=-1, sorted=False
        )
        ll.llama_sampler_apply(self._chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        ll.llama_sampler_accept(self._chain, token)
        return token

    def _candidates(
        self, ctx: ll.llama_context_p, output_index: int, logits: np.ndarray | None = None
    ) -> tuple[np.ndarray, ll.llama_token_data_array]:
        """The row's logits as llama.cpp's candidate array (what ``llama_sampler_sample`` builds)."""
        data = np.empty(self._n_vocab, dtype=_TOKEN_DATA)
        data["id"] = _token_ids(self._n_vocab)
        data["logit"] = _row(ctx, output_index, logits, self._n_vocab)
        data["p"] = 0.0
        cur = ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=self._n_vocab, selected=-1, sorted=False
        )
        return data, cur

    def _sample_constrained(self, ctx: ll.llama_context_p, output_index: int, logits: np.ndarray | None = None) -> int:
        """Grammar-constrained sampling at the cost of unconstrained sampling, mostly.

        The grammar sampler checks every candidate against the grammar (262,144 for Gemma:
        about as long as a decode step on a CPU). As llama.cpp's own server does, draw from the
        unconstrained distribution first and check only that token; when the grammar refuses
        it, apply the grammar to every candidate and draw again. Either way the token drawn is
        one the grammar allows, from the same chain (the grammar masks first on a redraw), and
        both the chain and the grammar accept it.
        """
        assert self._grammar is not None
        keep, cur = self._candidates(ctx, output_index, logits)
        ll.llama_sampler_apply(self._chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        one = (ll.llama_token_data * 1)(ll.llama_token_data(token, 1.0, 0.0))
        single = ll.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        ll.llama_sampler_apply(self._grammar, ctypes.byref(single))
        if one[0].logit == -math.inf:
            keep, cur = self._candidates(ctx, output_index, logits)
            ll.llama_sampler_apply(self._grammar, ctypes.byref(cur))
            ll.llama_sampler_apply(self._chain, ctypes.byref(cur))
            token = int(cur.data[cur.selected].id)
        del keep
        ll.llama_sampler_accept(self._grammar, token)
        ll.llama_sampler_accept(self._chain, token)
        return token

    def record_logprob(
        self,
        ctx: ll.llama_context_p,
        output_index: int,
        token: int,
        piece: Callable[[int], bytes],
        logits: np.ndarray | None = None,
    ) -> None:
        """Keep ``token``'s log-probability (log-softmax of the row's raw logits) and the top
        alternatives; only called for requests that asked (one pass over the vocabulary)."""
        if self._logprobs is None:
            return
        logits = _row(ctx, output_index, logits, self._n_vocab)
        peak = float(logits.max())
        lse = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
        top: list[tuple[int, bytes, float]] = []
        if self._top:
            best = np.argpartition(logits, -self._top)[-self._top :]
            best = best[np.argsort(logits[best])[::-1]]
            top = [(int(t), piece(int(t)), float(logits[t]) - lse) for t in best]
        self._logprobs.append(TokenLogprob(token, piece(token), float(logits[token]) - lse, top))

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs recorded since the last call (None when the request did not ask)."""
        if self._logprobs is None:
            return None
        out, self._logprobs = self._logprobs, []
        return out

    def free(self) -> None:
        if self._grammar is not None:
            ll.llama_sampler_free(self._grammar)
            self._grammar = None
        if self._chain is not None:
            ll.llama_sampler_free(self._chain)
            self._chain = None


class TextAssembler:
    """Bytes of tokens in, text safe to stream out (UTF-8 whole, stop sequences held back)."""

    __slots__ = ("_decoder", "_held", "_stops", "_window", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(stops)
        self._window = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that can be released now."""
        text = self._held + self._decoder.decode(data)
        if not self._stops:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        # Hold back the longest tail that is a prefix of some stop sequence.
        keep = 0
        for n in range(min(len(text), self._window - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                keep = n
                break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The rest, when the reply ends for another reason than a stop sequence."""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text


def _row(ctx: ll.llama_context_p, output_index: int, logits: np.ndarray | None, n_vocab: int) -> np.ndarray:
    """The logits row: ``logits`` when the context no longer holds it (``output_index`` < 0)."""
    if output_index < 0:
        assert logits is not None
        return logits
    return np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, output_index), shape=(n_vocab,))
