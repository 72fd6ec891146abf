"""Deciding each step's batch: which requests get how many tokens (pure; no model).

Continuous batching in one rule set: every decoding request gets exactly one token per
step, then prefill takes what is left of the batch, in arrival order, in bounded chunks
while others are decoding so a long prompt never freezes their streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Schedulable(Protocol):
    @property
    def decoding(self) -> bool: ...

    @property
    def prefill_remaining(self) -> int: ...

    @property
    def needs_logits(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Indexes into the active list with the number of tokens each contributes this step."""

    decode: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]

    @property
    def total(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


def plan_batch(active: Sequence[Schedulable], batch_tokens: int, prefill_chunk: int) -> BatchPlan:
    """One step's batch for ``active`` (in arrival order) within ``batch_tokens`` tokens."""
    decode = tuple(i for i, r in enumerate(active) if r.decoding)
    budget = batch_tokens - len(decode)
    if decode:
        budget = min(budget, prefill_chunk)
    prefill: list[tuple[int, int]] = []
    for i, r in enumerate(active):
        if budget <= 0:
            break
        n = r.prefill_remaining
        if not r.decoding and n > 0:
            # The last prompt token goes alone, like a decode step: the logits of a reply's
            # first token then never depend on how the prompt was split (batch invariance).
            take = min(n - 1 if n > 1 and r.needs_logits else n, budget)
            prefill.append((i, take))
            budget -= take
    return BatchPlan(decode, tuple(prefill))
