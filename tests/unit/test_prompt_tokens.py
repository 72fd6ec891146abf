"""A follow-up's prompt tokenized from the previous turn's tokens is the same as tokenized whole."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate, builtin_template
from hotloop_serve.engine.model import Model
from hotloop_serve.engine.prompt_tokens import PromptTokenizer

PIECES = [
    "Hello",
    " leading space",
    "trailing space ",
    "\n\nnewlines\n",
    "tab\there",
    "ünïcode 🎉",
    "",
    " ",
    "model",
    "code:\n```py\nprint(1)\n```",
    "a" * 200,
    "\n\n\n",
    "\t\t",
    "     ",
    "\n\n",
    # special tokens' texts inside a message: llama.cpp parses them as special tokens wherever
    # they are, so they move the cut points (the Gemma ones, and the tiny model's)
    "<end_of_turn>",
    "<start_of_turn>user",
    "<start_of_turn>",
    "<bos>",
    "x<eos>y",
    "</s>",
    "<s>user",
    "</s>\n",
]


def model_and_template(path: Path) -> tuple[Model, ChatTemplate]:
    model = Model(path, repack=False)
    source = model.metadata.chat_template or builtin_template(model.metadata.architecture)[1]
    return model, ChatTemplate(source, "test", model.token_text(model.bos), model.token_text(model.eos))


def conversations(seed: int, count: int, turns: int) -> Iterator[tuple[str, list[ChatMessage]]]:
    """(session key, history) for every turn of ``count`` random conversations, sometimes edited."""
    rng = random.Random(seed)

    def text() -> str:
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))

    for c in range(count):
        history = [ChatMessage("system", text() + " system")] if rng.random() < 0.5 else []
        for _ in range(turns):
            history.append(ChatMessage("user", text() or "hi"))
            if rng.random() < 0.15 and len(history) > 2:  # the client rewrote its last exchange
                history = [*history[:-3], history[-1]]
            yield f"s{c}", list(history)
            history.append(ChatMessage("assistant", text()))


@pytest.mark.parametrize("which", ["tiny", "gemma"])
def test_incremental_tokens_equal_whole_tokenization(which: str, tiny_model: Path, gemma_model: Path) -> None:
    model, template = model_and_template(tiny_model if which == "tiny" else gemma_model)
    try:
        prompts = PromptTokenizer(model, capacity=8)
        rng = random.Random(3)
        checked = 0
        for key, history in conversations(seed=7, count=60, turns=5):
            text = template.render(history, add_generation_prompt=rng.random() < 0.8)  # or a warmup
            assert prompts.tokenize(text, key) == model.tokenize(text), text[-300:]
            checked += 1
        assert checked == 300
        assert prompts.reused_tokens > 0  # the follow-ups did reuse the earlier turns' tokens
    finally:
        model.close()


def test_reuse_needs_the_same_text_up_to_the_cut(gemma_model: Path) -> None:
    model, template = model_and_template(gemma_model)
    try:
        prompts = PromptTokenizer(model, capacity=2)
        first = [ChatMessage("user", "Tell me about the sea. " * 40)]
        prompts.tokenize(template.render(first), "a")
        follow = [*first, ChatMessage("assistant", "It is wide."), ChatMessage("user", "And rivers?")]
        reused = prompts.reused_tokens
        assert prompts.tokenize(template.render(follow), "a") == model.tokenize(template.render(follow))
        assert prompts.reused_tokens - reused > 200  # the whole first turn
        # An edited first message shares nothing past the cut: tokenized whole, still right.
        edited = [ChatMessage("user", "Tell me about the lake. " * 40), *follow[1:]]
        reused = prompts.reused_tokens
        assert prompts.tokenize(template.render(edited), "a") == model.tokenize(template.render(edited))
        assert prompts.reused_tokens == reused
        # Keys are independent, forgotten on request, and the least recently used go first.
        prompts.tokenize(template.render(first), "b")
        prompts.forget("a")
        prompts.tokenize(template.render(follow), "a")
        assert prompts.reused_tokens == reused
        prompts.tokenize(template.render(first), "c")  # capacity 2: "b" is dropped
        prompts.tokenize(template.render(follow), "b")
        assert prompts.reused_tokens == reused
        # A prompt past max_tokens is not kept (the engine refuses or truncates it anyway).
        small = PromptTokenizer(model, max_tokens=100)
        small.tokenize(template.render(first), "a")
        assert small.tokenize(template.render(follow), "a") == model.tokenize(template.render(follow))
        assert small.reused_tokens == 0
        # Without a key nothing is kept or reused.
        assert prompts.tokenize(template.render(follow)) == model.tokenize(template.render(follow))
        assert prompts.reused_tokens == reused
    finally:
        model.close()
