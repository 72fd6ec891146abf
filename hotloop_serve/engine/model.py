"""Loading a GGUF model with llama.cpp and the vocabulary operations built on it.

Everything here is read-only after load, so tokenizing and detokenizing run on the callers'
threads, off the scheduler thread (llama.cpp's vocabulary is immutable once loaded).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as ll

from hotloop_serve.errors import InvalidArgument

_backend_lock = threading.Lock()
_PIECE_CACHE = 65536
"""Most token pieces a model keeps (a few MB); past it the cache starts again."""
_backend_ready = False
# Keep a reference to the ctypes log callback: a collected callback segfaults llama.cpp.
_LOG_CALLBACK = ll.llama_log_callback(lambda level, text, user_data: None)


def init_backend(quiet: bool = True) -> None:
    """Initialise llama.cpp once per process; silence its logging unless HOTLOOP_LLAMA_LOG is set."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        ll.llama_backend_init()
        if quiet and not os.environ.get("HOTLOOP_LLAMA_LOG"):
            ll.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        _backend_ready = True


@dataclass(frozen=True)
class ModelMetadata:
    """What GetModel reports, read from the GGUF header."""

    architecture: str
    description: str
    quantization: str
    train_context_length: int
    parameters: int
    size_bytes: int
    vocab_size: int
    chat_template: str | None


_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}  # fmt: skip


class Model:
    """A loaded GGUF model (weights + vocabulary). One per replica; shared by its context."""

    def __init__(self, path: str | Path, gpu_layers: int = 0, repack: bool = True, vocab_only: bool = False) -> None:
        """``vocab_only``: the tokenizer and metadata without the weights (the synthetic engine's)."""
        path = Path(path)
        if not path.is_file():
            raise InvalidArgument(f"model file not found: {path}")
        init_backend()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 2**31 - 1 if gpu_layers < 0 else gpu_layers
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only
        self.path = path
        self._ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self._ptr:
            raise InvalidArgument(f"llama.cpp could not load {path} (not a GGUF model, or unsupported architecture)")
        self.vocab = ll.llama_model_get_vocab(self._ptr)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self.vocab)
        self.bos: int = ll.llama_vocab_bos(self.vocab)
        self.eos: int = ll.llama_vocab_eos(self.vocab)
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self.metadata = self._read_metadata()
        self._eog_cache: dict[int, bool] = {}
        self._pieces: dict[int, bytes] = {}

    @property
    def ptr(self) -> ll.llama_model_p:
        return self._ptr

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when absent."""
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = ll.llama_model_meta_val_str(self._ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def _read_metadata(self) -> ModelMetadata:
        desc = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._ptr, desc, 256)
        tmpl = ll.llama_model_chat_template(self._ptr, None)
        file_type = self.meta("general.file_type")
        quant = _FILE_TYPES.get(int(file_type), f"type{file_type}") if file_type and file_type.isdigit() else "unknown"
        return ModelMetadata(
            architecture=self.meta("general.architecture") or "unknown",
            description=desc.value.decode("utf-8", errors="replace"),
            quantization=quant,
            train_context_length=int(ll.llama_model_n_ctx_train(self._ptr)),
            parameters=int(ll.llama_model_n_params(self._ptr)),
            size_bytes=int(ll.llama_model_size(self._ptr)),
            vocab_size=self.n_vocab,
            chat_template=tmpl.decode("utf-8") if tmpl else None,
        )

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Text -> tokens. parse_special lets template markers like <start_of_turn> become their tokens."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (control tokens render as nothing). Cached: called once per
        generated token, and each ctypes call hands the GIL to the replica's event loop."""
        hit = self._pieces.get(token)
        if hit is None:
            if len(self._pieces) >= _PIECE_CACHE:
                self._pieces.clear()
            hit = self._pieces[token] = self._render(token)
        return hit

    def _render(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        """A token's text with special tokens rendered (for templates' bos/eos strings)."""
        buf = ctypes.create_string_buffer(128)
        n = ll.llama_token_to_piece(self.vocab, token, buf, 128, 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, end-of-turn...). Cached: called once per generated token."""
        hit = self._eog_cache.get(token)
        if hit is None:
            hit = self._eog_cache[token] = bool(ll.llama_vocab_is_eog(self.vocab, token))
        return hit

    def close(self) -> None:
        if self._ptr:
            ll.llama_model_free(self._ptr)
            self._ptr = None
