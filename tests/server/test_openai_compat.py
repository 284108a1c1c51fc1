"""Where the server used to deviate from OpenAI's API (issue 32), checked with the official clients where they expose
the behaviour and on the wire where they do not: a tool call cut by max_tokens, max_tokens left out or too large,
`/v1/models/{id}` in both APIs' shapes, explicit nulls, logit_bias, the legacy functions, `finish_reason: null` in
chunks, a body without a JSON Content-Type, and admission before rendering."""
from __future__ import annotations

from http.client import HTTPConnection
import json
import threading

import anthropic
import openai
import pytest

from tests.server.conftest import MODEL, http
from tsterm.agent.tools import Calculator
from tsterm.config import SamplingParams

QUESTION = [{"role": "user", "content": "What is 37 * 12?"}]
TOOLS = [Calculator().spec()]
FUNCTIONS = [TOOLS[0]["function"]]


def _cut_call(client) -> tuple[int, str]:
    """(a max_tokens that cuts the model's calculator call inside its arguments, the full arguments string)."""
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, logprobs=True)
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    text = ""
    for n, entry in enumerate(whole.choices[0].logprobs.content, 1):
        text += entry.token
        if '"expression": "37' in text:
            return n, arguments
    raise AssertionError(f"the model did not write the call it used to: {text!r}")


# ---- a tool call cut by max_tokens ---------------------------------------------------------------------------


def test_a_call_cut_by_max_tokens_is_a_call_with_its_partial_arguments_and_comes_back_as_any_string(client):
    max_tokens, whole = _cut_call(client)
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=max_tokens)
    reply = client.chat.completions.create(**kwargs).choices[0]
    (call,) = reply.message.tool_calls
    assert reply.finish_reason == "length" and not reply.message.content  # no <tool_call> markup as text
    assert call.function.name == "calculator" and call.id
    assert whole.startswith(call.function.arguments) and '"expression": "37' in call.function.arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    # streamed, the same call, the same arguments, the same finish reason
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
    # echoed back as it came (OpenAI takes any string as arguments): the conversation goes on
    history = QUESTION + [reply.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "the call was cut short"}]
    follow_up = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0,
                                               max_tokens=8)
    assert follow_up.choices[0].message.role == "assistant"


# ---- max_tokens ----------------------------------------------------------------------------------------------


def test_max_tokens_left_out_runs_to_the_end_of_the_context_with_the_profile_s_other_defaults(make_server, server):
    profiled = make_server(defaults=SamplingParams(temperature=0, max_tokens=8))
    client = openai.OpenAI(base_url=f"{profiled.url}/v1", api_key="x", max_retries=0, timeout=120)
    story = [{"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(model=MODEL, messages=story, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == profiled.state.max_model_len  # not the profile's 8
    # the profile's temperature 0 still applies: the reply is the greedy one
    greedy = client.chat.completions.create(model=MODEL, messages=story, temperature=0, max_tokens=12)
    assert r.choices[0].message.content.startswith(greedy.choices[0].message.content)
    # /v1/completions: OpenAI's default there is 16 tokens
    c = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 16 and c.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_past_the_context_is_a_400_naming_the_limit(client, server, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **{field: 100_000_000})
    body = err.value.body
    room = server.state.max_model_len - 18  # the question's prompt has 18 tokens
    assert body["param"] == field and body["code"] == "context_length_exceeded"
    assert f"{field} is 100000000" in body["message"] and f"must be in [1, {room}]" in body["message"]
    with pytest.raises(openai.BadRequestError, match=r"must be in \[1, "):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=100_000_000)


# ---- models --------------------------------------------------------------------------------------------------


def test_models_retrieve_and_list_with_the_openai_client(client):
    (listed,) = client.models.list().data
    model = client.models.retrieve(MODEL)
    assert model.id == listed.id == MODEL and model.object == "model" and model.owned_by
    assert model.created == listed.created > 0
    # Anthropic's fields ride along
    extra = model.model_dump()
    assert extra["type"] == "model" and extra["display_name"] == MODEL and extra["created_at"].endswith("Z")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and "'gpt-4' does not exist" in err.value.body["message"]


def test_models_retrieve_and_list_with_the_anthropic_client(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    page = client.models.list()
    (listed,) = page.data
    assert listed.id == MODEL and listed.type == "model" and listed.display_name == MODEL
    assert page.has_more is False and page.first_id == page.last_id == MODEL
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.created_at == listed.created_at
    assert int(model.created_at.timestamp()) == openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.retrieve(
        MODEL).created
    assert client.models.list(after_id=MODEL).data == []
    with pytest.raises(anthropic.NotFoundError) as err:
        client.models.retrieve("claude-opus-4")
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    # the shapes on the wire: Anthropic's page for its clients, OpenAI's list otherwise
    status, body = http("GET", f"{server.url}/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert status == 200 and set(json.loads(body)) == {"data", "has_more", "first_id", "last_id"}
    status, body = http("GET", f"{server.url}/v1/models")
    assert status == 200 and set(json.loads(body)) == {"object", "data"}
    status, body = http("GET", f"{server.url}/v1/models?limit=0", headers={"anthropic-version": "2023-06-01"})
    assert status == 400 and json.loads(body)["error"]["message"] == "limit must be in [1, 1000], got 0"


# ---- nulls ---------------------------------------------------------------------------------------------------

NULLS = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "presence_penalty": None,
         "frequency_penalty": None, "repetition_penalty": None, "seed": None, "stop": None, "n": None,
         "stream": None, "stream_options": None, "ignore_eos": None, "user": None, "structured_outputs": None,
         "logit_bias": None}
CHAT_NULLS = {"max_completion_tokens": None, "logprobs": None, "top_logprobs": None, "tools": None,
              "tool_choice": None, "parallel_tool_calls": None, "response_format": None,
              "chat_template_kwargs": None, "functions": None, "function_call": None}


def test_explicit_nulls_are_fields_not_given(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello", "name": None, "tool_calls": None}],
            "max_tokens": 4, **NULLS, **CHAT_NULLS}
    status, body = http("POST", f"{server.url}/v1/chat/completions", chat)
    reply = json.loads(body)
    assert status == 200, body
    assert len(reply["choices"]) == 1 and reply["object"] == "chat.completion"  # n 1, not streamed
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "logprobs": None, "echo": None,
                  "suffix": None, **NULLS}
    status, body = http("POST", f"{server.url}/v1/completions", completion)
    assert status == 200 and json.loads(body)["object"] == "text_completion", body
    # a required field is still required
    status, body = http("POST", f"{server.url}/v1/chat/completions", {**chat, "messages": None})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"


# ---- logit_bias ----------------------------------------------------------------------------------------------


def _unbiased_first_token(llm, prompt_ids: list[int]) -> tuple[int, int]:
    """The greedy first token and the runner-up, from the engine itself without a bias."""
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0].outputs[0]
    (best, _), (second, _) = out.logprobs[0]["top"]
    assert best == out.token_ids[0]
    return best, second


def test_logit_bias_bans_and_forces_tokens(client, llm):
    prompt = llm.tokenizer.encode("Once upon a time")
    best, second = _unbiased_first_token(llm, prompt)
    banned = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                       logit_bias={str(best): -100})
    assert banned.choices[0].text == llm.tokenizer.decode([second])
    forced_id = llm.tokenizer.encode(" banana")[0]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                       temperature=1.0, seed=1, logprobs=True, logit_bias={str(forced_id): 100})
    tokens = [entry.token for entry in r.choices[0].logprobs.content]
    assert tokens == [llm.tokenizer.decode([forced_id])] * 5


@pytest.mark.parametrize("bias, fragment", [
    ({"banana": 1}, "'banana' is not a token id"),
    ({"99999999": 1}, "is not a token id of this model's vocabulary"),
    ({"5": 101}, "logit_bias[5] must be a number in [-100, 100]"),
    ({str(i): 1 for i in range(301)}, "logit_bias has 301 entries; at most 300"),
])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias, fragment):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, logit_bias=bias)
    assert err.value.body["param"] == "logit_bias" and fragment in err.value.body["message"]


# ---- the legacy functions / function_call --------------------------------------------------------------------


def test_legacy_functions_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, functions=FUNCTIONS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "calculator"
    assert json.loads(choice.message.function_call.arguments) == {"expression": "37 * 12"}
    streamed = list(client.chat.completions.create(model=MODEL, messages=QUESTION, functions=FUNCTIONS,
                                                   temperature=0, stream=True))
    calls = [c.choices[0].delta.function_call for c in streamed if c.choices[0].delta.function_call]
    assert calls[0].name == "calculator" and "".join(c.arguments for c in calls) == \
        choice.message.function_call.arguments
    assert streamed[-1].choices[0].finish_reason == "function_call"
    history = QUESTION + [{"role": "assistant", "content": None,
                           "function_call": choice.message.function_call.model_dump()},
                          {"role": "function", "name": "calculator", "content": "444"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, functions=FUNCTIONS, temperature=0)
    assert answer.choices[0].finish_reason == "stop" and "444" in answer.choices[0].message.content
    # a named function_call is a tool_choice naming it; "none" offers none
    hello = [{"role": "user", "content": "Hello"}]
    named = client.chat.completions.create(model=MODEL, messages=hello, functions=FUNCTIONS, temperature=0,
                                           function_call={"name": "calculator"}, max_tokens=40)
    assert named.choices[0].message.function_call.name == "calculator"
    none = client.chat.completions.create(model=MODEL, messages=QUESTION, functions=FUNCTIONS, temperature=0,
                                          function_call="none", max_tokens=30)
    assert none.choices[0].message.function_call is None and none.choices[0].finish_reason != "function_call"
    with pytest.raises(openai.BadRequestError, match="not among the functions"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, functions=FUNCTIONS,
                                       function_call={"name": "nope"})
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, functions=FUNCTIONS, tools=TOOLS)


# ---- the wire: finish_reason null, Content-Type ----------------------------------------------------------------


def _sse(server, path: str, body: dict) -> list[dict]:
    status, text = http("POST", f"{server.url}{path}", {**body, "stream": True})
    assert status == 200
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "n": 2}),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS}),
    ("/v1/completions", {"prompt": "Hello"}),
])
def test_stream_chunks_carry_finish_reason_null_until_their_last(server, path, body):
    chunks = _sse(server, path, {"model": MODEL, "max_tokens": 6, "temperature": 0, **body})
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert all("finish_reason" in c and "logprobs" in c for c in choices)
    for index in {c["index"] for c in choices}:
        reasons = [c["finish_reason"] for c in choices if c["index"] == index]
        assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in ("stop", "length", "tool_calls")


def test_a_json_body_without_a_json_content_type_is_read(server):
    good = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d; a bare client
        status, body = http("POST", f"{server.url}/v1/chat/completions", good, headers={"Content-Type": content_type})
        assert status == 200 and json.loads(body)["object"] == "chat.completion", body
    connection = HTTPConnection("127.0.0.1", server.port, timeout=60)  # no Content-Type at all
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Length", str(len(good)))
    connection.endheaders(good.encode())
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["object"] == "chat.completion"
    connection.close()
    status, body = http("POST", f"{server.url}/v1/chat/completions", "model=agent-demo&max_tokens=2",
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]


# ---- admission before rendering --------------------------------------------------------------------------------


def test_the_lease_is_taken_before_the_template_renders_and_given_back_on_every_path(make_server, llm, monkeypatch):
    server = make_server(max_queued_requests=1)
    tokenizer, render = llm.tokenizer, llm.tokenizer.apply_chat_template
    rendering, go = threading.Event(), threading.Event()

    def slow_render(*args, **kwargs):  # the first request holds here, inside its render, until the test says go
        if not go.is_set():
            rendering.set()
            go.wait()
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow_render)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    first: list = []
    thread = threading.Thread(target=lambda: first.append(http("POST", f"{server.url}/v1/chat/completions", body)))
    thread.start()
    rendering.wait()
    status, text = http("POST", f"{server.url}/v1/chat/completions", body)  # refused before it renders
    assert status == 429 and "limit of 1 requests in flight" in json.loads(text)["error"]["message"]
    status, _ = http("POST", f"{server.url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 429
    go.set()
    thread.join()
    assert first[0][0] == 200
    # the paths that end in an error after the lease was taken give it back
    failing = [("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "word " * 3000}]}),
               ("/v1/chat/completions", {**body, "max_tokens": 100_000}),
               ("/v1/chat/completions", {**body, "response_format": {"type": "json_schema", "json_schema": {
                   "name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}}}),
               ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}),
               ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 100_000})]
    for path, bad in failing:
        assert http("POST", f"{server.url}{path}", bad)[0] == 400
    server.served.wait("/v1/chat/completions", 5)
    server.served.wait("/v1/completions", 3)
    assert server.state.in_flight == 0
    assert http("POST", f"{server.url}/v1/chat/completions", body)[0] == 200
