"""Third-party agent frameworks against `tsterm serve`, each as its users call it, on a loopback server: pydantic-ai's
`NativeOutput`, LangChain's `with_structured_output`, instructor's JSON-schema mode and the OpenAI Agents SDK's
`output_type` (structured outputs through `response_format` json_schema, on the default profile's model), and the
Agents SDK's tool loop on its chat-completions model and on its default, the Responses API (agent-demo, which was
trained to call `calculator`).

Each framework validates the reply itself (pydantic-ai and instructor raise, LangChain reports a parsing error), so
a server that let the reply out of the schema fails these tests in the framework, as it would for its users."""
from __future__ import annotations

import json
from typing import Any

import instructor
import openai
import pytest
from agents import (Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, OpenAIProvider,
                    OpenAIResponsesModel, RunConfig, Runner)
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider as PydanticOpenAIProvider

from tests.server.conftest import MODEL as AGENT_DEMO
from tests.server.test_structured_outputs import MODEL as DEFAULT
from tests.server.test_structured_outputs import default_server  # noqa: F401 (the default model's server fixture)
from tsterm.agent.tools import Calculator

PROMPT = "Describe the city of Paris."


class City(BaseModel):
    """A city."""
    # instructor sends the schema as pydantic writes it, without `strict`: forbidding extra keys is what puts
    # `additionalProperties: false` in it (pydantic-ai and LangChain add it themselves, as OpenAI's strict mode needs)
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=10_000_000)  # bounded: greedy, the small model repeats digits


def test_pydantic_ai_native_output(default_server):  # noqa: F811
    provider = PydanticOpenAIProvider(base_url=f"{default_server.url}/v1", api_key="unused")
    model = OpenAIChatModel(DEFAULT, provider=provider)
    agent = PydanticAgent(model, output_type=NativeOutput(City))
    result = agent.run_sync(PROMPT, model_settings={"temperature": 0, "max_tokens": 120})
    assert isinstance(result.output, City)
    (reply,) = result.all_messages()[-1].parts  # NativeOutput: the reply is the JSON text, not a tool call
    assert City.model_validate_json(reply.content) == result.output
    assert result.all_messages()[-1].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # LangChain's own dump of a streamed `parsed`
def test_langchain_with_structured_output(default_server, stream):  # noqa: F811
    llm = ChatOpenAI(model=DEFAULT, base_url=f"{default_server.url}/v1", api_key="unused", temperature=0,
                     max_tokens=120, max_retries=0, streaming=stream)
    structured = llm.with_structured_output(City, method="json_schema", include_raw=True)
    result = structured.invoke(PROMPT)
    assert result["parsing_error"] is None and isinstance(result["parsed"], City)
    assert City.model_validate_json(result["raw"].content) == result["parsed"]


def test_instructor_json_schema_mode(default_server):  # noqa: F811
    client = instructor.from_openai(openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused",
                                                  max_retries=0), mode=instructor.Mode.JSON_SCHEMA)
    city, completion = client.chat.completions.create_with_completion(
        model=DEFAULT, response_model=City, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=120, max_retries=0)  # no re-ask: the first reply must validate
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"
    assert City.model_validate_json(completion.choices[0].message.content).model_dump() == city.model_dump()


async def test_openai_agents_sdk_output_type(default_server):  # noqa: F811
    async with openai.AsyncOpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        agent = Agent(name="cities", output_type=City,  # the SDK sends it as a strict json_schema response_format
                      model=OpenAIChatCompletionsModel(model=DEFAULT, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=120))
        result = await Runner.run(agent, PROMPT, run_config=RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, City)
    (message,) = result.new_items
    assert City.model_validate_json(message.raw_item.content[0].text) == result.final_output


def _calculator_tool(calls: list[dict]) -> FunctionTool:
    """tsterm's calculator as an Agents SDK function tool, with the schema agent-demo was trained on; `calls` gets
    the arguments of each call the SDK runs."""
    calculator = Calculator()

    async def invoke(context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return calculator.run(calls[-1])

    return FunctionTool(name=calculator.name, description=calculator.description,
                        params_json_schema=calculator.parameters, on_invoke_tool=invoke, strict_json_schema=True)


async def _calculator_run(model, stream: bool) -> tuple[list[dict], Any]:
    """An Agents SDK run of "What is 37 * 12?" with the calculator on `model`: (the calls the SDK ran, its result)."""
    calls: list[dict] = []
    # tool_choice "required" makes the first reply a call (the server's grammar); the SDK resets it to "auto" after
    # the call, so the second reply can answer
    agent = Agent(name="calculator", tools=[_calculator_tool(calls)], model=model,
                  model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=60,
                                               include_usage=True))  # streamed usage: the SDK asks only OpenAI's host
    config = RunConfig(tracing_disabled=True)
    if not stream:
        return calls, await Runner.run(agent, "What is 37 * 12?", run_config=config)
    result = Runner.run_streamed(agent, "What is 37 * 12?", run_config=config)
    async for _ in result.stream_events():
        pass
    return calls, result


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_sdk_tool_loop_on_chat_completions(server, stream):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        calls, result = await _calculator_run(OpenAIChatCompletionsModel(model=AGENT_DEMO, openai_client=client),
                                              stream)
    assert calls == [{"expression": "37 * 12"}]
    assert "444" in result.final_output  # the tool's result came back to the model, which answered with it
    first, second = result.context_wrapper.usage.request_usage_entries
    # the SDK's echo of the call and its result re-renders to what the model emitted: the first turn is cached
    assert second.input_tokens_details.cached_tokens >= (first.input_tokens + first.output_tokens - 1) // 16 * 16


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_sdk_tool_loop_on_its_default_responses_model(server, stream):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = OpenAIProvider(openai_client=client).get_model(AGENT_DEMO)  # what the SDK makes of a model name
        assert isinstance(model, OpenAIResponsesModel)
        calls, result = await _calculator_run(model, stream)
    assert calls == [{"expression": "37 * 12"}]
    assert "444" in result.final_output
    assert [r.response_id[:5] for r in result.raw_responses] == ["resp_", "resp_"]  # both turns by /v1/responses
    first, second = result.context_wrapper.usage.request_usage_entries
    # the SDK sends the whole conversation again (no previous_response_id): the server matches it to the first turn
    assert second.input_tokens_details.cached_tokens >= (first.input_tokens + first.output_tokens - 1) // 16 * 16
