"""Tool calling in the engine: formats, rendering, the call grammar, the streaming parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.chat_template import ChatTemplate, builtin_template
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.grammar import check_grammar
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.tool_grammar import avoiding, literal, rename_rules, tool_grammar
from hotloop_serve.engine.tool_parser import ToolCallParser
from hotloop_serve.engine.tools import GEMMA, HERMES, LLAMA3, ToolCall, ToolChoice, ToolFormat, ToolSpec, detect_format
from hotloop_serve.errors import InvalidArgument

WEATHER = ToolSpec(
    "get_weather",
    "The weather in a city.",
    json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
TIME = ToolSpec(
    "get_time",
    "The local time in a timezone.",
    json.dumps(
        {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}
    ),
)
FORMATS = [GEMMA, HERMES, LLAMA3]


def builtin(name: str) -> ChatTemplate:
    origin_name, source = builtin_template({"gemma": "gemma3", "llama3": "llama", "chatml": "qwen2"}[name])
    assert origin_name == name
    return ChatTemplate(source, f"builtin:{name}", "<bos>")


# ------------------------------------------------------------------------- formats, rendering


def test_each_template_family_has_its_format_and_unknown_templates_refuse_tools() -> None:
    assert builtin("gemma").tool_format is GEMMA
    assert builtin("llama3").tool_format is LLAMA3
    assert builtin("chatml").tool_format is HERMES
    qwen = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}{% if tools %}<tool_call>{% endif %}"
    native = detect_format(qwen + "{{ m.tool_calls }}", "gguf")
    assert native is not None and native.native and native.name == "hermes"
    assert detect_format("{% for m in messages %}<start_of_turn>{{ m.content }}{% endfor %}", "gguf") is GEMMA
    odd = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}", "gguf")
    assert odd.tool_format is None
    assert odd.render([M("user", "hi")]) == "[user] hi"
    with pytest.raises(InvalidArgument, match="no tool-calling syntax") as info:
        odd.render([M("user", "hi")], tools=[WEATHER])
    assert info.value.field == "tools"


def test_gemma_lowers_definitions_calls_and_results_into_its_turns() -> None:
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    history = [
        M("system", "Be brief."),
        M("user", "Weather in Paris?"),
        M("assistant", "", tool_calls=(call,)),
        M("tool", "sunny, 21 C", tool_call_id="call_1", name="get_weather"),
    ]
    text = builtin("gemma").render(history, tools=[WEATHER])
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nYou can call functions.")
    assert json.dumps(WEATHER.openai_json()) in text
    assert '<start_of_turn>model\n```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```' in text
    assert "<start_of_turn>user\n```tool_output\nsunny, 21 C\n```<end_of_turn>\n<start_of_turn>model\n" in text


def test_a_rendered_call_is_the_text_the_grammar_forces_so_the_next_turn_extends_the_cache() -> None:
    """What the model generated (head + arguments + tail) re-renders byte for byte."""
    for fmt in FORMATS:
        head, tail = fmt.call_parts("get_weather")
        generated = head + '{"city":"Oslo"}' + tail
        assert fmt.call_text("get_weather", '{"city":"Oslo"}') == generated
        assert generated.startswith(fmt.trigger)


def test_llama3_results_come_back_in_an_ipython_turn() -> None:
    call = ToolCall("c", "get_time", '{"tz": "UTC"}')
    history = [M("user", "time?"), M("assistant", "", tool_calls=(call,)), M("tool", "12:00", tool_call_id="c")]
    text = builtin("llama3").render(history, tools=[TIME])
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_time", "parameters": {"tz": "UTC"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n12:00<|eot_id|>" in text


def test_a_native_template_gets_tools_and_calls_as_hugging_face_passes_them() -> None:
    source = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
        "{% if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %};{% endfor %}"
    )
    template = ChatTemplate(source, "gguf")
    assert template.tool_format is not None and template.tool_format.native
    call = ToolCall("c1", "get_weather", '{"city": "Rome"}')
    history = [M("user", "hi"), M("assistant", "", tool_calls=(call,)), M("tool", "hot", tool_call_id="c1")]
    assert template.render(history, tools=[WEATHER]) == (
        "TOOL get_weather;user:hi;assistant:<tool_call>get_weather Rome;tool:hot(c1);"
    )


# ------------------------------------------------------------------------- grammar


def test_rename_rules_touches_names_only() -> None:
    gbnf = 'root ::= "{" space x-kv "}"  # c\nspace ::= | " " | "\\n" [ \\t]{0,20}\nx-kv ::= "\\"x\\"" [^"\\\\]'
    renamed = rename_rules(gbnf, "t3-")
    assert renamed.startswith('t3-root ::= "{" t3-space t3-x-kv "}"  # c\nt3-space ::= | " " | "\\n" [ \\t]{0,20}')
    assert renamed.endswith('t3-x-kv ::= "\\"x\\"" [^"\\\\]')


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [True, False])
def test_every_tool_grammar_is_valid_gbnf(fmt: ToolFormat, mode: str, parallel: bool) -> None:
    choice = ToolChoice("required", "get_time") if mode == "named" else ToolChoice(mode)
    grammar = tool_grammar(fmt, [WEATHER, TIME], choice, parallel)
    assert grammar is not None
    check_grammar(grammar)
    assert ("t0-root" in grammar) == (mode != "named")


def test_no_grammar_without_calls() -> None:
    assert tool_grammar(GEMMA, [WEATHER], ToolChoice("none"), True) is None
    assert tool_grammar(GEMMA, [], ToolChoice("auto"), True) is None


def test_the_text_automaton_avoids_exactly_the_trigger() -> None:
    """Simulate the rules: a string is accepted as text iff it does not contain the trigger."""
    trigger = "abab"
    rules = dict(r.split(" ::= ", 1) for r in avoiding(trigger, "CALL"))

    def run(text: str) -> str:
        state = "text-0"
        for ch in text:
            alts = [a.strip() for a in rules[state].split("| ") if a.strip()]
            nxt = None
            for alt in alts:
                match, target = alt.split(" ")
                if match == literal(ch) or (match.startswith("[^") and literal(ch)[1:-1] not in match):
                    nxt = target
                    break
            assert nxt is not None, (state, ch)
            if nxt == "CALL":
                return "call"
            state = nxt
        return "text"

    for text in ["", "aba", "abaab", "aabba", "ababx", "xxabab", "abaabab", "bbbb abac"]:
        assert run(text) == ("call" if trigger in text else "text"), text


# ------------------------------------------------------------------------- parser


def _parse(fmt: ToolFormat, text: str, step: int) -> tuple[str, list[ToolCall], bool, list[str]]:
    ids = iter(f"id{i}" for i in range(10))
    parser = ToolCallParser(fmt, ["get_weather", "get_time"], new_id=lambda: next(ids))
    content, firsts = "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        content += out.content
        firsts += [d.name or "" for d in out.calls if d.id]
    content += parser.finish().content
    return content, parser.calls, parser.complete, firsts


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_parser_splits_text_and_calls_however_the_reply_streams(fmt: ToolFormat, step: int) -> None:
    weather = fmt.call_text("get_weather", '{"city": "Paris {x}", "n": [1, {"a": "}"}]}')
    time = fmt.call_text("get_time", '{"tz": "UTC"}')
    text = "Let me look that up.\n" + weather + fmt.separator + time
    content, calls, complete, firsts = _parse(fmt, text, step)
    assert content == "Let me look that up.\n"
    assert complete and firsts == ["get_weather", "get_time"]
    assert calls == [
        ToolCall("id0", "get_weather", '{"city": "Paris {x}", "n": [1, {"a": "}"}]}'),
        ToolCall("id1", "get_time", '{"tz": "UTC"}'),
    ]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_text_without_a_call_passes_through_and_a_cut_call_is_incomplete(fmt: ToolFormat) -> None:
    plain = "No tools needed: " + fmt.trigger[:-1] + " is not a call."
    assert _parse(fmt, plain, 2)[:3] == (plain, [], False)
    cut = fmt.call_text("get_weather", '{"city": "Pa')[: -len(fmt.close) - 1 or None]
    content, calls, complete, _ = _parse(fmt, cut, 4)
    assert content == "" and not complete and calls[0].arguments.startswith('{"city": "Pa')
    head = fmt.call_text("get_weather", "{}")
    for end in range(len(fmt.trigger), len(head) - 4):  # cut by max_tokens inside the call's head
        content, calls, complete, _ = _parse(fmt, "Sure: " + head[:end], 3)
        assert fmt.trigger not in content and content.startswith("Sure: "), (end, content)
        assert not complete


def test_the_parser_turns_unexpected_syntax_into_text() -> None:
    text = '```tool_call\n{"name": "launch_rockets"}'
    content, calls, complete, _ = _parse(GEMMA, text, 5)
    assert content == text and calls == [] and not complete


# ------------------------------------------------------------------------- the engine


OPTS = EngineOptions(context_tokens=8192, session_context_tokens=4096, hot_sessions=2)  # byte tokens


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    """The tiny model with a ChatML template given in the config (its own is of no known family)."""
    with Engine(str(tiny_model), OPTS, chat_template=builtin_template("qwen2")[1]) as e:
        yield e


def test_a_template_of_no_known_family_refuses_tools(tiny_model: Path) -> None:
    with Engine(str(tiny_model), OPTS) as e:
        assert e.template.tool_format is None
        with pytest.raises(InvalidArgument, match="no tool-calling syntax"):
            e.generate("s", "p", [M("user", "hi")], tools=[WEATHER])


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_the_tiny_models_random_text_makes_valid_calls_under_the_grammar(engine: Engine, mode: str) -> None:
    """The tiny model writes random text; the grammar alone makes its calls parse and validate."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = engine.template.tool_format
    assert fmt is HERMES  # recognised by its <|im_start|> turns
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [ToolSpec("get_weather", "", json.dumps(city)), TIME]  # bounded arguments: random text ends
    grammar = tool_grammar(fmt, tools, ToolChoice(mode), parallel=True)
    history = [M("user", "What is the weather in Paris?")]
    calls_seen = 0
    for seed in range(4):
        settings = SamplingSettings(temperature=1.0, seed=seed, sample_len=400, grammar=grammar or "")
        final = engine.generate(f"s{seed}", "p", history, settings, tools=tools).result()
        parser = ToolCallParser(fmt, [t.name for t in tools])
        parser.feed(final.text)
        content = parser.finish().content
        if final.finish_reason == "length":
            continue
        if mode == "required":
            assert content == "" and parser.complete, final.text
        if parser.calls:
            assert parser.complete, final.text
        assert fmt.trigger not in content
        for call in parser.calls:
            calls_seen += 1
            spec = next(t for t in tools if t.name == call.name)
            jsonschema.validate(json.loads(call.arguments), json.loads(spec.parameters))
    assert mode == "auto" or calls_seen
