"""llama.cpp's saved state of one sequence, read without llama.cpp: is it consistent?

``llama_state_seq_set_data`` trusts what it reads about positions: a state whose cells say
positions 0..276 under a token list of 434 loads fine, and the next ``llama_decode`` of that
sequence fails the whole batch (every session in it) because the positions do not continue.
Session exports are authenticated (``persist.py``), so only this fleet's blobs get here; this
module is the second line: before a blob's state is loaded, its structure is walked and
checked against the model's own (learned once from a one-token state of this context) and
its cells against the blob's tokens.

The format (``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write``, llama.cpp
as vendored by llama-cpp-python 0.3.36): a ``u32`` magic and the ``i32`` sequence id it was saved
from, then per cache (two for sliding-window models: the full-attention one, then the window one) a
``u32`` stream count, then per stream a ``u32`` cell count and, for a non-empty stream, the
cells' metadata (``i32`` position, ``u32`` sequence count (1), an optional per-cell extension,
``i32`` sequence id), then ``u32`` v_trans, ``u32`` layers, each layer's keys (``i32`` type,
``u64`` row size, the rows), each layer's values (the same, or transposed: ``i32`` type,
``u32`` element size, ``u32`` rows, the elements).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from hotloop_serve.errors import InvalidArgument

STATE_MAGIC = 0xAF143CD8
"""``io_magic`` of llama-context.cpp: the first word of a sequence's state."""
CELL_EXTENSIONS = (0, 12)
"""Bytes of ``llama_kv_cell_ext`` per cell: none, or (x, y, token) for M-RoPE and PLE models."""


class StateError(ValueError):
    """The bytes are not a state of this layout (the message says where)."""


@dataclass(frozen=True)
class CacheLayout:
    """What one cache writes whatever its cells: everything but the cells and their rows."""

    streams: int
    ext: int
    v_trans: int
    keys: tuple[tuple[int, int], ...]
    """Per layer: (ggml type, bytes per cell row)."""
    values: tuple[tuple[int, int, int], ...]
    """Per layer with values: (ggml type, bytes per cell row or element, rows (transposed) or 0)."""


@dataclass(frozen=True)
class StateLayout:
    caches: tuple[CacheLayout, ...]


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data).cast("B")
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.left():
            raise StateError(f"{what} runs past the end of the state ({n} bytes, {self.left()} left)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def _read_cells(r: _Reader, count: int, ext: int) -> np.ndarray:
    """The positions of ``count`` cells, each of one sequence (what a one-sequence state holds)."""
    record = 12 + ext
    if count > r.left() // record:
        raise StateError(f"{count} cells do not fit in the {r.left()} bytes left")
    fields = [("pos", "<i4"), ("n_seq", "<u4")]
    if ext:
        fields.append(("ext", f"V{ext}"))
    fields.append(("seq", "<i4"))
    dtype = np.dtype(fields)
    cells = np.frombuffer(r.take(count * record, "cell metadata"), dtype=dtype)
    if not np.all(cells["n_seq"] == 1):
        raise StateError("a cell belongs to more or fewer than one sequence")
    return np.array(cells["pos"], dtype=np.int64)


def _read_cache(r: _Reader, want: CacheLayout | None, ext: int) -> tuple[CacheLayout, list[np.ndarray]]:
    """One cache's streams: its layout as read (checked against ``want``) and each non-empty
    stream's cell positions."""
    (streams,) = r.unpack("<I", "stream count")
    if want is not None and streams != want.streams:
        raise StateError(f"{streams} streams where this model's context has {want.streams}")
    if streams > 256:
        raise StateError(f"{streams} streams")
    found: list[np.ndarray] = []
    layout: CacheLayout | None = want
    for _ in range(streams):
        (count,) = r.unpack("<I", "cell count")
        if count == 0:
            continue
        found.append(_read_cells(r, count, ext))
        v_trans, layers = r.unpack("<II", "layer header")
        if want is not None and (v_trans != want.v_trans or layers != len(want.keys)):
            raise StateError(f"{layers} layers (v_trans {v_trans}) where the model has {len(want.keys)}")
        if layers > 4096:
            raise StateError(f"{layers} layers")
        keys = []
        for i in range(layers):
            kind, row = r.unpack("<iQ", "key header")
            if want is not None and (kind, row) != want.keys[i]:
                raise StateError(f"layer {i} keys are type {kind}, {row} bytes a row; the model's: {want.keys[i]}")
            r.take(count * row, f"layer {i} keys")
            keys.append((kind, row))
        values = []
        n_values = len(want.values) if want is not None else layers
        for i in range(n_values):
            if v_trans:
                kind, size, rows = r.unpack("<iII", "value header")
                span = size * rows * count
            else:
                kind, size = r.unpack("<iQ", "value header")
                rows, span = 0, size * count
            if want is not None and (kind, size, rows) != want.values[i]:
                raise StateError(f"layer {i} values are type {kind}, {size} bytes; the model's: {want.values[i]}")
            r.take(span, f"layer {i} values")
            values.append((kind, size, rows))
        layout = CacheLayout(streams, ext, v_trans, tuple(keys), tuple(values))
    if layout is None:  # no cells at all: nothing tells the layers; an empty state of any model
        layout = CacheLayout(streams, ext, 0, (), ())
    return layout, found


def _read_prefix(r: _Reader) -> None:
    magic, _seq = r.unpack("<Ii", "state header")
    if magic != STATE_MAGIC:
        raise StateError(f"not a sequence state (magic {magic:#x})")


def learn_layout(state: bytes | memoryview) -> StateLayout:
    """The layout of this context's states, from the state of a sequence holding exactly one
    token at position 0 (the model's own export); StateError if it cannot be read as one."""
    errors = []
    for ext in CELL_EXTENSIONS:
        r = _Reader(state)
        caches: list[CacheLayout] = []
        try:
            _read_prefix(r)
            while r.left():
                layout, found = _read_cache(r, None, ext)
                if [list(p) for p in found] != [[0]]:
                    raise StateError(f"cells at {[list(p) for p in found]}, expected one at position 0")
                caches.append(layout)
                if len(caches) > 4:
                    raise StateError("more than 4 caches")
        except StateError as e:
            errors.append(f"extension {ext}: {e}")
            continue
        if caches:
            return StateLayout(tuple(caches))
    raise StateError("; ".join(errors) or "empty state")


def check_state(state: bytes | memoryview, n_tokens: int, layout: StateLayout) -> None:
    """InvalidArgument unless ``state`` is a state of this model's layout holding exactly the
    positions 0..n_tokens-1 (the first cache) and a contiguous run of them ending at the last
    (a sliding-window cache keeps only its window)."""
    r = _Reader(state)
    try:
        _read_prefix(r)
        for index, want in enumerate(layout.caches):
            _, found = _read_cache(r, want, want.ext)
            if len(found) > 1:
                raise StateError(f"cache {index} holds cells in {len(found)} streams")
            positions = np.sort(found[0]) if found else np.zeros(0, dtype=np.int64)
            if index == 0:
                if len(positions) != n_tokens or not np.array_equal(positions, np.arange(n_tokens)):
                    raise StateError(
                        f"the cache holds {len(positions)} cells"
                        + (f" at positions {positions[0]}..{positions[-1]}" if len(positions) else "")
                        + f" for {n_tokens} tokens"
                    )
            elif len(positions):
                first = n_tokens - len(positions)
                if first < 0 or not np.array_equal(positions, np.arange(first, n_tokens)):
                    raise StateError(
                        f"window cache {index} holds {len(positions)} cells that are not the last of {n_tokens} tokens"
                    )
            elif n_tokens:
                raise StateError(f"window cache {index} holds no cells for {n_tokens} tokens")
        if r.left():
            raise StateError(f"{r.left()} bytes past the end of the state")
    except StateError as e:
        raise InvalidArgument(f"session export's KV state is inconsistent: {e}", reason="INCONSISTENT_STATE") from None
