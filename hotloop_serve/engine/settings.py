"""Per-session sampling settings: one frozen, validated object.

Mirrors ``hotloop.v1.Settings`` field for field (``serve/convert.py`` holds the one
conversion). Validation lives here, not in the servicer, so every entry point (gRPC, the
engine's Python API, benches) rejects the same bad values with the same message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hotloop_serve.engine.grammar import MAX_GRAMMAR_BYTES, check_grammar, schema_to_grammar
from hotloop_serve.errors import InvalidArgument

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 256
MAX_SEED = 2**64 - 1
MAX_TOP_LOGPROBS = 20
"""Most alternatives reported per token (OpenAI's bound)."""


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """How a session samples; the defaults are hot-loop's, plus min_p and stop sequences."""

    temperature: float = 0.8
    """Softmax temperature; 0 means greedy (argmax), whatever the other fields say."""
    sample_len: int = 256
    """Most tokens generated in one turn."""
    seed: int | None = None
    """Fixed seed for reproducible sampling; None draws a fresh seed every turn."""
    top_p: float = 0.95
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    top_k: int = 40
    """Keep the k most likely tokens; 0 disables it."""
    repeat_penalty: float = 1.1
    """Penalty on tokens seen in the last ``repeat_last_n``; 1 disables it."""
    repeat_last_n: int = 64
    """How many recent tokens of the reply being generated the repeat penalty looks at (as in
    hot-loop: the history is not penalized, and end-of-generation tokens never are)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Generation ends before the first of these strings; it is not returned."""
    min_p: float = 0.05
    """Drop tokens whose probability is below min_p times the best one's; 0 disables it."""
    truncate_history: bool = False
    """Drop the oldest turns (never the system prompt) rather than fail when history is too long."""
    grammar: str = ""
    """A GBNF grammar (llama.cpp's syntax, start symbol ``root``) every reply must match, enforced by
    llama.cpp's grammar sampler; empty: none. Exclusive with ``json_schema``."""
    json_schema: str = ""
    """A JSON Schema (JSON text) every reply must match, converted to a grammar by the converter
    that ships with llama-cpp-python; ``{"type": "object"}`` asks for any JSON object."""
    logprobs: bool = False
    """Report the log-probability of each generated token (under the model's raw distribution)."""
    top_logprobs: int = 0
    """With ``logprobs``: also the most likely alternatives at each position, 0-20."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(
        self, max_sample_len: int | None = None, context_tokens: int | None = None, vocab_size: int | None = None
    ) -> None:
        """Raise InvalidArgument naming the first bad field, with the accepted range.

        The optional bounds are the serving engine's (its sample_len cap, a session's context
        window, the model's vocabulary): with them every field is bounded before anything is
        allocated for it, whatever the caller sends.
        """
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.sample_len, int) or self.sample_len < 1:
            raise InvalidArgument(f"sample_len must be >= 1, got {self.sample_len}")
        if max_sample_len is not None and self.sample_len > max_sample_len:
            raise InvalidArgument(f"sample_len must be <= {max_sample_len} on this server, got {self.sample_len}")
        if context_tokens is not None and self.sample_len > context_tokens:
            raise InvalidArgument(
                f"sample_len must be <= {context_tokens} (a session's context window), got {self.sample_len}"
            )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2^64), got {self.seed}")
        _finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidArgument(f"top_k must be <= {vocab_size} (the model's vocabulary), got {self.top_k}")
        _finite("repeat_penalty", self.repeat_penalty)
        if self.repeat_penalty <= 0:
            raise InvalidArgument(f"repeat_penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise InvalidArgument(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if context_tokens is not None and self.repeat_last_n > context_tokens:
            raise InvalidArgument(
                f"repeat_last_n must be <= {context_tokens} (a session's context window), got {self.repeat_last_n}"
            )
        _finite("min_p", self.min_p)
        if not 0 <= self.min_p < 1:
            raise InvalidArgument(f"min_p must be in [0, 1), got {self.min_p}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidArgument(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidArgument(f"stop sequences must be 1-{MAX_STOP_LENGTH} characters, got {len(s)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.grammar and self.json_schema:
            raise InvalidArgument("grammar and json_schema are exclusive: send one of them")
        for name in ("grammar", "json_schema"):
            text = getattr(self, name)
            if len(text.encode()) > MAX_GRAMMAR_BYTES:
                raise InvalidArgument(
                    f"{name} must be at most {MAX_GRAMMAR_BYTES} bytes, got {len(text.encode())}", field=name
                )
        # Static bounds only (cheap on any thread): the trial build in llama.cpp is the engine's
        # (Engine.validate), off the event loop.
        if self.grammar:
            check_grammar(self.grammar)
        elif self.json_schema:
            schema_to_grammar(self.json_schema)

    def merged(self, **overrides: Any) -> SamplingSettings:
        """A copy with the given fields replaced (None values are ignored)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise InvalidArgument(f"unknown settings: {sorted(unknown)}")
        if "stop" in given:
            given["stop"] = tuple(given["stop"])
        return replace(self, **given)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_grammar(self) -> str:
        """The GBNF the sampler enforces: ``grammar``, or ``json_schema`` converted; empty: none."""
        if self.grammar:
            return self.grammar
        if self.json_schema:
            return schema_to_grammar(self.json_schema)
        return ""


def _finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
