"""llama.cpp's micro-batches of one call with per-session streams, modelled for the tests.

``llama_batch_allocr::split_equal(n_ubatch, sequential=true)`` (llama-batch.cpp of the vendored
llama.cpp): each micro-batch takes, in batch order, the first unused row's sequence and then
every sequence whose id is the previous one + 1, and as many rows of each as all of them have
left. Deterministic mode's call shapes (``engine/canonical.py``) rely on it.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(seqs: Sequence[int]) -> list[list[int]]:
    """The batch indices of each micro-batch of a call whose rows belong to ``seqs``."""
    used = [False] * len(seqs)
    out: list[list[int]] = []
    while not all(used):
        chosen: list[int] = []
        for i, s in enumerate(seqs):
            if used[i] or s in chosen:
                continue
            if not chosen or s == chosen[-1] + 1:
                chosen.append(s)
        left = {s: [i for i, t in enumerate(seqs) if t == s and not used[i]] for s in chosen}
        count = min(len(v) for v in left.values())
        batch = [i for s in chosen for i in left[s][:count]]
        for i in batch:
            used[i] = True
        out.append(sorted(batch))
    return out
