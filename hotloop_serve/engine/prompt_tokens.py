"""A conversation's next prompt in tokens, without tokenizing its whole history again.

Why: every turn carries the whole history, and tokenizing it is on the turn's critical path:
it takes longer beside an engine that keeps the cores busy, and it grows with the
conversation (``bench/prompt_tokens.py`` measures it). A
follow-up's rendered prompt starts with the previous turn's, whose tokens are kept here: only
the text after the last special token they share is tokenized.

Why it is exact: llama.cpp first cuts the text at every special token (the longest first), then
tokenizes each piece of raw text on its own; an SPM vocabulary gives a piece after a special
token the same space prefix wherever it starts, a BPE one none. So the tokens of a text cut
right after a special token are the tokens before the cut followed by those of the rest,
unless

- the text of another special token spans the cut (it would win the cut): checked against
  every special token's text,
- the special token's text can overlap itself (Gemma's runs of newlines, spaces and tabs are
  special tokens): never cut there, or
- the special token strips the whitespace after it (``RSTRIP``) and the rest starts with
  whitespace: checked.

Other vocabulary types (WPM, UGM, RWKV) are always tokenized whole.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

import llama_cpp as ll

from hotloop_serve.engine.model import Model

__all__ = ["PromptTokenizer"]

_SPECIAL = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED | ll.LLAMA_TOKEN_ATTR_UNKNOWN
"""The tokens llama.cpp matches in raw text when it parses special tokens (its special-token cache)."""


def _overlaps_itself(text: str) -> bool:
    return any(text[:k] == text[-k:] for k in range(1, len(text)))


class _Specials:
    """The vocabulary's special tokens as llama.cpp's tokenizer sees them (built once: it walks
    the whole vocabulary)."""

    def __init__(self, model: Model) -> None:
        self.text: dict[int, str] = {}
        self.rstrip: set[int] = set()
        for token in range(model.n_vocab):
            attr = ll.llama_vocab_get_attr(model.vocab, token)
            if attr & _SPECIAL:
                raw = ll.llama_vocab_get_text(model.vocab, token)
                text = raw.decode("utf-8", errors="replace") if raw else ""
                if text:
                    self.text[token] = text
                    if attr & ll.LLAMA_TOKEN_ATTR_RSTRIP:
                        self.rstrip.add(token)
        self.cuttable = frozenset(t for t, text in self.text.items() if not _overlaps_itself(text))
        """Tokens whose text cannot overlap another occurrence of itself (not ``\n\n``, say):
        llama.cpp parses the first of two overlapping occurrences, the cut would be taken after
        the last one."""
        self.texts = frozenset(self.text.values())
        self.heads = frozenset(t[:i] for t in self.texts for i in range(1, len(t)))
        """Every proper prefix of a special token's text: where one may start before a cut."""
        self.longest = max((len(t) for t in self.texts), default=0)

    def spans(self, text: str, cut: int) -> bool:
        """Whether a special token's text covers both ``text[cut - 1]`` and ``text[cut]``."""
        for start in range(max(0, cut - self.longest + 1), cut):
            if text[start:cut] not in self.heads:
                continue
            for end in range(cut + 1, min(len(text), start + self.longest) + 1):
                if text[start:end] in self.texts:
                    return True
        return False


class PromptTokenizer:
    """Tokenizes prompts (``Model.tokenize(text)``, special tokens parsed), reusing the tokens of
    the last prompt tokenized under the same key (a session) when the new text extends it.

    Thread-safe: requests are tokenized on their callers' threads. Keeps the last prompt of at
    most ``capacity`` keys (least recently used dropped), tokens as 4-byte ints, and only prompts
    of at most ``max_tokens`` (a longer one is refused or truncated by the engine anyway): a caller
    sending huge histories cannot make it hold more than ``capacity x max_tokens`` tokens.
    """

    def __init__(self, model: Model, capacity: int = 64, max_tokens: int = 1 << 20) -> None:
        self._model = model
        self._capacity = capacity
        self._max_tokens = max_tokens
        self._enabled = ll.llama_vocab_type(model.vocab) in (ll.LLAMA_VOCAB_TYPE_SPM, ll.LLAMA_VOCAB_TYPE_BPE)
        # Built here, not on first use: a burst of follow-ups would each build it on a busy core
        # (the first turn after a burst then started late).
        self._specials = _Specials(model) if self._enabled else None
        self._lock = threading.Lock()
        self._last: OrderedDict[str, tuple[str, array[int]]] = OrderedDict()
        self.reused_tokens = 0
        """Tokens taken from earlier prompts instead of tokenized again (for tests and stats)."""

    def tokenize(self, text: str, key: str | None = None) -> list[int]:
        if key is None or not self._enabled:
            return self._model.tokenize(text)
        with self._lock:
            last = self._last.get(key)
        tokens = self._extend(last, text) if last is not None else None
        if tokens is None:
            tokens = self._model.tokenize(text)
        with self._lock:
            if len(tokens) > self._max_tokens:
                self._last.pop(key, None)
                return tokens
            self._last[key] = (text, array("i", tokens))
            self._last.move_to_end(key)
            while len(self._last) > self._capacity:
                self._last.popitem(last=False)
        return tokens

    def forget(self, key: str) -> None:
        with self._lock:
            self._last.pop(key, None)

    def _extend(self, last: tuple[str, array[int]], text: str) -> list[int] | None:
        """``text``'s tokens from the last prompt's up to its last special token, or None."""
        before, tokens = last
        specials = self._specials
        assert specials is not None  # enabled
        index = next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i] in specials.text), None)
        if index is None:
            return None
        token = tokens[index]
        if token not in specials.cuttable:
            return None
        special = specials.text[token]
        # The last occurrence of its text is this token: a later one would have been parsed as
        # a special token too, and a longer special token holding it would come after it.
        cut = before.rfind(special) + len(special)
        if cut > len(text) or not text.startswith(before[:cut]):
            return None
        if token in specials.rstrip and text[cut : cut + 1].isspace():
            return None
        if specials.spans(text, cut):
            return None
        rest = self._model.tokenize(text[cut:]) if cut < len(text) else []
        with self._lock:
            self.reused_tokens += index + 1
        return [*tokens[: index + 1], *rest]
