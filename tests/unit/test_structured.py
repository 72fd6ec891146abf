"""Structured output (grammar, JSON Schema) and logprobs in the engine, on the tiny GGUF and Gemma."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import InvalidArgument

GREEDY = SamplingSettings(temperature=0, sample_len=24, repeat_penalty=1.0)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(str(tiny_model), EngineOptions(context_tokens=2048, session_context_tokens=1024, hot_sessions=2)) as e:
        yield e


HISTORY = [M("user", "Say something.")]


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"json_schema": '{"type": 5}'}, "json_schema is not supported: Unrecognized schema"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"json_schema": '{"$ref": "#/definitions/nope"}'}, "json_schema is not supported"),
        ({"grammar": 'root ::= "a'}, "grammar is not valid GBNF"),
        ({"grammar": 'start ::= "a"'}, "no 'root' rule"),
        ({"grammar": 'root ::= "a"', "json_schema": "{}"}, "exclusive"),
        ({"grammar": "x" * (64 * 1024 + 1)}, "at most"),
        ({"top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ],
)
def test_bad_structured_settings_are_invalid_argument(engine: Engine, settings: dict[str, object], says: str) -> None:
    """Static bounds fail as the settings are built; llama.cpp's own parser runs in the engine's
    trial build (``GrammarProbe``), so what only it can refuse fails there, with the same status."""
    with pytest.raises(InvalidArgument) as info:
        engine.validate(SamplingSettings(**settings))  # type: ignore[arg-type]
    assert says in info.value.message


def test_a_grammar_constrains_every_reply(engine: Engine) -> None:
    """The tiny model's vocabulary is random text: the grammar alone makes the reply 'yes' or 'no'."""
    settings = SamplingSettings(temperature=1.0, seed=7, sample_len=16, grammar='root ::= "yes" | "no"')
    for i in range(3):
        final = engine.generate(f"g{i}", "p", HISTORY, settings).result()
        assert final.text in ("yes", "no"), final.text
        assert final.finish_reason == "eos"


def test_logprobs_match_the_text_and_greedy_picks_the_top_token(engine: Engine) -> None:
    settings = GREEDY.merged(logprobs=True, top_logprobs=3)
    final = engine.generate("l", "p", HISTORY, settings).result()
    assert final.logprobs is not None and final.usage is not None
    assert len(final.logprobs) == final.usage.completion_tokens
    assert b"".join(lp.piece for lp in final.logprobs).decode("utf-8", errors="replace") == final.text
    for lp in final.logprobs:
        assert lp.logprob <= 0 and math.isfinite(lp.logprob)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token  # greedy: the sampled token is the best
        assert lp.top[0][2] == pytest.approx(lp.logprob)
        assert [t[2] for t in lp.top] == sorted((t[2] for t in lp.top), reverse=True)


def test_no_logprobs_unless_asked(engine: Engine) -> None:
    final = engine.generate("n", "p", HISTORY, GREEDY).result()
    assert final.logprobs is None


def test_a_json_schema_reply_from_gemma_parses_and_validates(gemma_model: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    opts = EngineOptions(context_tokens=2048, session_context_tokens=2048, hot_sessions=2)
    settings = SamplingSettings(temperature=0.7, seed=3, sample_len=64, json_schema=json.dumps(PERSON))
    with Engine(str(gemma_model), opts) as e:
        final = e.generate("s", "p", [M("user", "Describe a person named Ann, aged 31, as JSON.")], settings).result()
    jsonschema.validate(json.loads(final.text), PERSON)
