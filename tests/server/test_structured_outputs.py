"""Structured outputs through `tsterm serve`: OpenAI's `response_format` (json_object, json_schema with the official
client's `parse`) and vLLM's `structured_outputs` field, on the default profile's model (SmolLM2-135M-Instruct) on
the CPU, and a schema llguidance cannot compile answered with a 400 naming the client's field."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tsterm import LLM
from tsterm.engine.async_engine import AsyncEngine
from tsterm.launch import engine_config
from tsterm.profiles import SHIPPED_DIR, load_profile
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "Describe the city of Paris."}]
WHERE = [{"role": "user", "content": "Where is Paris? Give the city and its country."}]  # in prose, unconstrained
GREEDY = {"temperature": 0, "max_tokens": 120}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)  # bounded: greedy, the small model repeats digits

@pytest.fixture(scope="module")
def default_server():
    """The shipped `default` profile's model (as its engine options load it) behind a loopback server."""
    profile = load_profile(str(SHIPPED_DIR / "default.yaml"))
    llm = LLM(str(engine_config(profile).model), **profile.engine_options())
    aengine = AsyncEngine(llm.engine)
    server = BackgroundServer(create_app(build_state(aengine, MODEL))).start()
    yield server
    server.stop()
    aengine.shutdown()
    llm.engine.shutdown()


@pytest.fixture
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_an_instance_of_the_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=QUESTION, response_format=City, **GREEDY)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY).choices[0].message.content
    assert free != choice.message.content  # unconstrained, the model answers in prose


def test_json_object_is_a_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=WHERE, response_format={"type": "json_object"}, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content) == {"city": "Paris",
                                                                                               "country": "France"}
    text = client.chat.completions.create(model=MODEL, messages=WHERE, response_format={"type": "text"}, **GREEDY)
    assert text.choices[0].message.content.startswith("Paris is")  # "text" constrains nothing


def test_a_streamed_structured_reply_is_the_non_streamed_one(client):
    schema = {**City.model_json_schema(), "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=QUESTION, response_format={  # enforced though not strict, as vLLM does
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": False}}, **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content and City.model_validate_json(streamed)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_vllm_structured_outputs_field(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={
        "structured_outputs": {"choice": ["sunny", "rainy"]}}, **GREEDY)
    assert r.choices[0].message.content in ("sunny", "rainy") and r.choices[0].finish_reason == "stop"
    c = client.completions.create(model=MODEL, prompt="The year Paris hosted the Olympics:", extra_body={
        "structured_outputs": {"regex": r" [12][0-9]{3}"}}, **GREEDY)
    assert c.choices[0].text[1:].isdigit() and len(c.choices[0].text) == 5


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_cannot_be_compiled_is_a_400_naming_the_field(client, stream):
    lookahead = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=a)[a-z]+$"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream, response_format={
            "type": "json_schema", "json_schema": {"name": "code", "schema": lookahead, "strict": True}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "look-around" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream,
                                       response_format={"type": "json_schema", "json_schema": {"name": "nothing"}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream,
                                       extra_body={"structured_outputs": {"regex": "(?<=x)y"}})
    assert err.value.body["param"] == "structured_outputs.regex" and "look-around" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream,
                                       extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert err.value.body["param"] == "structured_outputs"


def test_a_response_format_and_a_required_tool_call_conflict(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"
