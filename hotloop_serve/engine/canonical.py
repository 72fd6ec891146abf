"""Deterministic mode's call shapes: which rows go into which ``llama_decode``.

llama.cpp's CPU kernels compute a row alike in every micro-batch of 2 to 7 rows, whatever the
other rows are and whatever cells the other sequences hold (bench/results/invariance.md,
docs/reliability.md). Outside that class they change their arithmetic: from 8 rows the matrix
products, from 64 flash attention's tiled path (its KV tiles follow cell indices), and a
micro-batch of exactly one row over more than 256 cells takes flash attention's split-KV path
(ggml-cpu ``ops.cpp``, ``use_split_kv_path``: one query row of one stream and ``n_kv >= 512``,
``n_kv`` being the cells in use padded to 256), which sums per-thread parts of the cells, so
its result follows the cells in use and the thread count.

What a micro-batch is, is llama.cpp's choice: with per-session streams it cuts a call
(``llama-batch.cpp``, ``split_equal(..., sequential=true)``) into micro-batches of sequences
with *consecutive, increasing* ids, the same number of rows of each. So single rows of
sequences 0, 2 and 5 in one call run as three 1-row micro-batches, and a ballast row of another
sequence beside a lone row shares its micro-batch only when its id is the next one. This
module lays out every call so that each micro-batch holds 2 to 7 rows: single rows sorted by
sequence, in runs of consecutive ids, and a row whose sequence has no neighbour in its call
followed by a *shadow row*: a second row of the same sequence, one position further, whose
cell the runner removes again after the call. The shadow is causally after the real row, so
the real row does not see it (masked cells are skipped, not added), and the pair is one
micro-batch of one stream with two rows, never the split-KV path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hotloop_serve.engine.scheduler import Piece

Rows = list[tuple[int, int, int]]
"""One ``llama_decode``'s rows: (index of the piece, its first token in this batch, token count)."""

DETERMINISTIC_ROWS = 7
"""Most rows of one ``llama_decode`` in deterministic mode (shadow rows included): llama.cpp's
CPU kernels give a row the same result in micro-batches of 2 to 7 rows, and another from 8."""


@dataclass(frozen=True, slots=True)
class CanonicalDecode:
    """One ``llama_decode`` of a deterministic step."""

    rows: Rows
    shadows: tuple[int, ...] = ()
    """Pieces (single rows) whose row is followed by a shadow row of its sequence: a position
    past the row, removed after the call, so that the row's micro-batch has two rows."""

    @property
    def size(self) -> int:
        """Rows of the call, shadows included."""
        return sum(n for _, _, n in self.rows) + len(self.shadows)


def canonical_decodes(pieces: Sequence[Piece]) -> list[CanonicalDecode]:
    """The ``llama_decode`` calls of a deterministic step: each row computed exactly as alone.

    A prompt slice is cut into chunks of 2-7 of its own rows, one call each (a call of several
    sequences of unequal row counts is cut by llama.cpp into micro-batches of equal counts,
    which could leave a row alone), so a token's cells are the same whether it was prefilled,
    in any chunks, or decoded. Single rows (decoders, a prompt's last token) are sorted by
    sequence and grouped in runs of consecutive ids (llama.cpp's micro-batches), a run cut into
    parts of at least 2 rows; a part of one row gets a shadow row; parts fill calls of at
    most 7 rows, in sequence order.
    """
    singles: list[int] = []
    decodes: list[CanonicalDecode] = []
    for i, p in enumerate(pieces):
        n = len(p.tokens)
        if n == 1:
            singles.append(i)
            continue
        chunks = -(-n // DETERMINISTIC_ROWS)
        start = 0
        for k in range(chunks):
            count = n // chunks + (1 if k < n % chunks else 0)
            decodes.append(CanonicalDecode([(i, start, count)]))
            start += count
    rows: Rows = []
    shadows: list[int] = []
    for part in _parts(sorted(singles, key=lambda i: pieces[i].seq), pieces):
        cost = max(len(part), 2)
        if rows and len(rows) + len(shadows) + cost > DETERMINISTIC_ROWS:
            decodes.append(CanonicalDecode(rows, tuple(shadows)))
            rows, shadows = [], []
        rows += [(i, 0, 1) for i in part]
        if len(part) == 1:
            shadows.append(part[0])
    if rows:
        decodes.append(CanonicalDecode(rows, tuple(shadows)))
    return decodes


def _parts(singles: list[int], pieces: Sequence[Piece]) -> list[list[int]]:
    """``singles`` (sorted by sequence) as llama.cpp's micro-batches of at most 7 rows: runs of
    consecutive sequence ids, a longer run cut into near-equal parts (each of 4 rows or more)."""
    runs: list[list[int]] = []
    for i in singles:
        if runs and pieces[i].seq == pieces[runs[-1][-1]].seq + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts: list[list[int]] = []
    for run in runs:
        k = -(-len(run) // DETERMINISTIC_ROWS)
        start = 0
        for j in range(k):
            count = len(run) // k + (1 if j < len(run) % k else 0)
            parts.append(run[start : start + count])
            start += count
    return parts
