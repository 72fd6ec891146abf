"""Deterministic mode's call shapes against llama.cpp's micro-batching (model-free)."""

from __future__ import annotations

from llama_split import micro_batches

from hotloop_serve.engine.canonical import DETERMINISTIC_ROWS, CanonicalDecode, canonical_decodes
from hotloop_serve.engine.scheduler import Piece


def call_seqs(pieces: list[Piece], d: CanonicalDecode) -> list[int]:
    """The sequence of each row of the call, in batch order (a shadow right after its row)."""
    seqs = []
    for i, _, n in d.rows:
        seqs += [pieces[i].seq] * n
        if i in d.shadows:
            seqs.append(pieces[i].seq)
    return seqs


def test_a_micro_batch_never_holds_one_row() -> None:
    """One row alone in a micro-batch takes flash attention's split-KV path past 256 cells
    (another sum than in any other shape); llama.cpp makes micro-batches of consecutive
    sequence ids, so single rows of sequences 0, 2, 5 used to run alone, each of them."""
    decoders = [0, 2, 5, 3, 4, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30]
    pieces = [Piece(seq=s, pos=300 + s, tokens=[7], logits=True, decoding=True) for s in decoders]
    pieces.append(Piece(seq=7, pos=0, tokens=list(range(40)), logits=True))
    decodes = canonical_decodes(pieces)
    rows = sorted((i, start) for d in decodes for i, start, n in d.rows for start in range(start, start + n))
    assert rows == sorted((i, k) for i, p in enumerate(pieces) for k in range(len(p.tokens)))
    for d in decodes:
        seqs = call_seqs(pieces, d)
        assert 2 <= len(seqs) == d.size <= DETERMINISTIC_ROWS, d
        for mb in micro_batches(seqs):
            assert 2 <= len(mb) <= DETERMINISTIC_ROWS, (d, mb)


def test_consecutive_sessions_share_a_micro_batch_without_shadows() -> None:
    pieces = [Piece(seq=s, pos=10, tokens=[1], logits=True, decoding=True) for s in (3, 1, 0, 2)]
    assert canonical_decodes(pieces) == [CanonicalDecode([(2, 0, 1), (1, 0, 1), (3, 0, 1), (0, 0, 1)])]


def test_a_lone_row_gets_a_shadow_of_its_own_sequence() -> None:
    pieces = [Piece(seq=2, pos=900, tokens=[5], logits=True, decoding=True)]
    assert canonical_decodes(pieces) == [CanonicalDecode([(0, 0, 1)], shadows=(0,))]
