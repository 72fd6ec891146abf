"""The grammar trial child: ``python grammar_probe.py MODEL MEMORY_BYTES`` (standard library,
llama-cpp-python and NumPy only: it is run by path, without the package).

Started and fed by :class:`hotloop_serve.engine.grammar.GrammarProbe`, one JSON line per grammar
on stdin, one JSON line per verdict on stdout. It loads only the model's vocabulary, caps its own
address space, and runs llama.cpp's grammar parser, its initial stacks and a few sampling steps
over the whole vocabulary on a thread whose stack is smaller than any of the replica's threads:
whatever passes here cannot overflow a stack, exhaust memory or stall in the replica, and
whatever would crashes or stalls only this process, which the parent then kills and replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import resource
import sys
import threading
import time
from typing import Any

import llama_cpp as ll
import numpy as np

PROBE_STACK_BYTES = 1 << 20
"""Stack of the thread that parses: a quarter of the smallest thread stack the replica builds
grammars on (Python's default, 8 MiB on Linux, or 2 MiB where that is unlimited)."""

_log: list[str] = []


def _collect(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if len(_log) < 64:
        _log.append(text.decode(errors="replace"))


_collect_log = ll.llama_log_callback(_collect)
"""Kept referenced for the process's life: llama.cpp calls it (a collected callback crashes)."""


def _vocab(path: str) -> tuple[Any, Any, int]:
    params = ll.llama_model_default_params()
    params.vocab_only = True
    params.use_mmap = False
    model = ll.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise SystemExit(f"could not load the vocabulary of {path}")
    vocab = ll.llama_model_get_vocab(model)
    return model, vocab, int(ll.llama_vocab_n_tokens(vocab))


def _cap_memory(extra: int) -> None:
    """Let the address space grow by at most ``extra`` bytes from here (the vocabulary is loaded)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * resource.getpagesize() + extra
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class Trial:
    """Build one grammar's sampler and sample a few tokens with it over the whole vocabulary."""

    def __init__(self, vocab: Any, n_vocab: int) -> None:
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.data = (ll.llama_token_data * n_vocab)()
        self.view = np.ctypeslib.as_array(
            ctypes.cast(self.data, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab * 3,)
        ).reshape(n_vocab, 3)
        ids = np.arange(n_vocab, dtype=np.int32)
        self.view[:, 0] = ids.view(np.float32)  # llama_token_data.id is an int32 in the first slot
        self.rng = np.random.default_rng(0)

    def _pick(self, allowed: np.ndarray) -> int | None:
        """A random allowed token that does not end generation (None: the grammar is complete)."""
        for _ in range(16):
            if len(allowed) == 0:
                return None
            token = int(allowed[int(self.rng.integers(len(allowed)))])
            if not ll.llama_vocab_is_eog(self.vocab, token):
                return token
        return None

    def run(self, grammar: str, steps: int) -> dict[str, Any]:
        _log.clear()
        t0 = time.perf_counter()
        sampler = ll.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            said = " ".join(" ".join(_log).split()) or "llama.cpp's parser refused it"
            return {"ok": False, "error": f"grammar is not valid GBNF ({said[:500]})"}
        built = time.perf_counter() - t0
        try:
            taken = 0
            for _ in range(steps):
                self.view[:, 1] = self.rng.random(self.n_vocab, dtype=np.float32)
                self.view[:, 2] = 0.0
                cur = ll.llama_token_data_array(self.data, self.n_vocab, -1, False)
                ll.llama_sampler_apply(sampler, ctypes.byref(cur))
                allowed = np.flatnonzero(np.isfinite(self.view[:, 1]))
                token = self._pick(allowed)
                if token is None:
                    break
                ll.llama_sampler_accept(sampler, token)
                taken += 1
        finally:
            ll.llama_sampler_free(sampler)
        return {"ok": True, "build_ms": round(built * 1e3, 3), "steps": taken}


def main() -> None:
    path, extra = sys.argv[1], int(sys.argv[2])
    ll.llama_log_set(_collect_log, ctypes.c_void_p(0))
    _model, vocab, n_vocab = _vocab(path)
    trial = Trial(vocab, n_vocab)
    _cap_memory(extra)
    threading.stack_size(PROBE_STACK_BYTES)
    out = sys.stdout.buffer
    out.write(json.dumps({"ready": True, "n_vocab": n_vocab}).encode() + b"\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        answer: dict[str, Any] = {}

        def work(request: dict[str, Any] = request, answer: dict[str, Any] = answer) -> None:
            try:
                answer.update(trial.run(str(request["grammar"]), int(request.get("steps", 8))))
            except MemoryError:
                answer.update(ok=False, error="grammar needs more memory than allowed")

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        out.write(json.dumps(answer or {"ok": False, "error": "grammar check failed"}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
