"""The OpenAI Agents SDK (``openai-agents``), a client nobody here wrote, against our endpoints.

An ``Agent`` with two function tools is run by the SDK's ``Runner`` over both of its model
classes, ``OpenAIResponsesModel`` (``/v1/responses``) and ``OpenAIChatCompletionsModel``
(``/v1/chat/completions``), on the shared server's ``gemma-3-270m`` application (auth off: a
local caller). The task needs both tools, one after the other: the city's code from the first,
the forecast for that code from the second, then an answer of the agent's ``output_type`` (the
SDK sends its JSON Schema as the response format, alongside the tools).

The embedded model is a 270M *base* model: it writes valid calls when a call is forced, but it
does not plan. So the run forces each step through the SDK's own knobs: the agent starts with
``tool_choice`` naming the first tool (``reset_tool_choice=False`` keeps the SDK from resetting
it; ``parallel_tool_calls=False``, else the forced model repeats the call), and a
``RunHooks.on_tool_end`` hook names the next tool, then ``none`` for the answer (the SDK reads
``agent.model_settings`` afresh every turn). Everything else (the tool schemas it
derives, the calls it parses, the results it sends back, the turns) is the SDK's own doing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from .conftest import SINGLE, Server

pytestmark = pytest.mark.integration

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

CODES = {"Paris": "FR-PAR", "Oslo": "NO-OSL"}
FORECASTS = {"FR-PAR": "sunny, 21 C", "NO-OSL": "snow, -3 C"}


class Answer(BaseModel):
    """The agent's final output (bounded, so that even a rambling base model's JSON ends)."""

    city: Literal["Paris", "Oslo"]
    forecast: str = Field(max_length=40)


@pytest.fixture(scope="module")
def base_url(server: Server) -> Iterator[str]:
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise
    yield f"http://127.0.0.1:{server.config.server.http_port}/{SINGLE}/v1"


class ForceNextTool(agents.RunHooks[Any]):  # type: ignore[misc]
    """After each tool, force the next one of ``order``; after the last, ``none`` (answer in text)."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.ended: list[str] = []

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
        self.ended.append(tool.name)
        at = self.order.index(tool.name) if tool.name in self.order else len(self.order)
        following = self.order[at + 1] if at + 1 < len(self.order) else "none"
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=following)


def run_agent(model: Any) -> tuple[Any, list[tuple[str, dict[str, Any]]], ForceNextTool]:
    called: list[tuple[str, dict[str, Any]]] = []

    @agents.function_tool
    def lookup_city_code(city: Literal["Paris", "Oslo"]) -> str:
        """The weather service's code for a city."""
        called.append(("lookup_city_code", {"city": city}))
        return CODES[city]

    @agents.function_tool
    def get_forecast(code: Literal["FR-PAR", "NO-OSL"]) -> str:
        """Today's forecast for a city code (from lookup_city_code)."""
        called.append(("get_forecast", {"code": code}))
        return FORECASTS[code]

    hooks = ForceNextTool(["lookup_city_code", "get_forecast"])
    agent = agents.Agent(
        name="forecaster",
        instructions="Find the city's code with lookup_city_code, then its forecast with get_forecast, then answer.",
        tools=[lookup_city_code, get_forecast],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="lookup_city_code", parallel_tool_calls=False, temperature=0, max_tokens=48
        ),
        reset_tool_choice=False,
        output_type=Answer,
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris today?", hooks=hooks, max_turns=6))
    return result, called, hooks


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_completes_a_two_tool_task_over_both_model_classes(base_url: str, api: str) -> None:
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=180)
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    result, called, hooks = run_agent(model_class(model=SINGLE, openai_client=client))
    assert [name for name, _ in called] == ["lookup_city_code", "get_forecast"], called
    assert hooks.ended == ["lookup_city_code", "get_forecast"]
    assert called[0][1]["city"] in CODES and called[1][1]["code"] in FORECASTS  # valid by the grammar
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == [CODES[called[0][1]["city"]], FORECASTS[called[1][1]["code"]]]
    assert isinstance(result.final_output, Answer)  # the model's answer (tool_choice none), parsed by the SDK
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert all(json.loads(c.raw_item.arguments) for c in calls)
    usage = result.context_wrapper.usage
    assert usage.requests == 3 and usage.input_tokens > 0
    assert usage.input_tokens_details.cached_tokens > 0.5 * usage.input_tokens  # turns 2 and 3 were hot
