"""The Anthropic Messages API (`POST /v1/messages`) on a real server and engine (agent-demo on the CPU), driven by
the official `anthropic` client."""
from __future__ import annotations

import json
import re
import threading

import anthropic
import openai
import pytest
import transformers

from tests.server.conftest import AGENT_DEMO, MODEL, http, wait_blocks_free
from tsterm.agent.tools import Calculator

GREEDY = {"temperature": 0}  # this client version has no temperature argument: sent as an extra body field
QUESTION = [{"role": "user", "content": "What is 37 * 12?"}]
_SPEC = Calculator().spec()["function"]
TOOLS = [{"name": _SPEC["name"], "description": _SPEC["description"], "input_schema": _SPEC["parameters"]}]


def prompt_tokens(usage) -> int:
    """The whole prompt as Anthropic counts it: computed + read from the cache + written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_text_non_streaming(claude):
    r = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hello"}])
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and isinstance(r.content[0].text, str)
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert 0 < r.usage.output_tokens <= 8 and r.usage.input_tokens > 0 and r.usage.cache_creation_input_tokens == 0


def test_streaming_equals_non_streaming(claude):
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=GREEDY,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_tool_round_trip_reuses_the_cache(claude):
    first = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=QUESTION, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "calculator" and call.input == {"expression": "37 * 12"}
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "444"}]}]
    second = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=history, tools=TOOLS)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert "444" in second.content[0].text
    assert second.usage.cache_read_input_tokens > 0


def test_streamed_tool_use(claude):
    with claude.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=QUESTION, tools=TOOLS) as s:
        final = s.get_final_message()
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and call.input == {"expression": "37 * 12"}
    assert call.id.startswith("toolu_")


def test_stop_sequence(claude):
    base = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=QUESTION, tools=TOOLS,
                                  tool_choice={"type": "none"})
    text = base.content[0].text
    assert len(text.strip()) > 2
    stop = text.strip()[1:3]
    r = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=QUESTION, tools=TOOLS,
                               tool_choice={"type": "none"}, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert stop not in r.content[0].text and text.startswith(r.content[0].text)


def test_system_prompt_reaches_the_prompt(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION)
    with_system = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION,
                                         system=[{"type": "text", "text": "You are terse."}])
    as_string = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION,
                                       system="You are terse.")
    assert prompt_tokens(with_system.usage) > prompt_tokens(plain.usage)
    assert prompt_tokens(with_system.usage) == prompt_tokens(as_string.usage)


def test_bad_requests_are_anthropic_errors(claude, server):
    bad = [dict(messages=QUESTION),  # no max_tokens
           dict(messages=QUESTION, max_tokens="many"),
           dict(messages="hello", max_tokens=4),
           dict(messages=QUESTION, max_tokens=4, tool_choice={"type": "tool", "name": "nope"}, tools=TOOLS),
           dict(messages=[{"role": "user", "content": "word " * 50000}], max_tokens=4)]
    for fields in bad:
        status, text = http("POST", f"{server.url}/v1/messages", {"model": MODEL, **fields})
        assert status == 400, (fields.keys(), text)
        parsed = json.loads(text)
        assert parsed["type"] == "error" and parsed["error"]["type"] == "invalid_request_error"
        assert parsed["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="nope", max_tokens=4, messages=QUESTION)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x " * 50000}])
    ok = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION)
    assert ok.content and ok.usage.output_tokens > 0


def test_api_key(make_server):
    keyed = make_server(api_key="sekrit")
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=QUESTION)
    assert err.value.body["error"]["type"] == "authentication_error"
    r = anthropic.Anthropic(base_url=keyed.url, api_key="sekrit", max_retries=0).messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION)
    assert r.usage.output_tokens > 0
    status, _ = http("POST", f"{keyed.url}/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": QUESTION},
                     headers={"Authorization": "Bearer sekrit"})
    assert status == 200


def test_tool_choice_any_makes_the_reply_a_call(claude):
    r = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Hello"}],
                               tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    assert r.content[0].name == "calculator" and set(r.content[0].input) == {"expression"}


def test_disconnect_mid_stream_aborts(claude, llm, aengine):
    before = llm.engine.metrics.requests_finished.get("abort", 0)
    with claude.messages.stream(model=MODEL, max_tokens=800, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Tell a long story"}]) as stream:
        events = iter(stream)
        for _ in range(6):
            next(events)
        assert aengine.stats()["used"] > 0
    assert wait_blocks_free(aengine)["used"] == 0
    assert llm.engine.metrics.requests_finished.get("abort", 0) == before + 1


def test_count_tokens_is_what_the_request_would_cost(claude):
    kwargs = dict(model=MODEL, system="You are terse.", messages=QUESTION, tools=TOOLS)
    counted = claude.messages.count_tokens(**kwargs)
    reply = claude.messages.create(max_tokens=4, extra_body=GREEDY, **kwargs)
    assert counted.input_tokens == prompt_tokens(reply.usage) > 0
    required = claude.messages.count_tokens(**kwargs, tool_choice={"type": "any"})
    called = claude.messages.create(max_tokens=40, extra_body=GREEDY, **kwargs, tool_choice={"type": "any"})
    assert called.stop_reason == "tool_use"  # held to a call by its grammar, which adds no prompt tokens
    assert required.input_tokens == prompt_tokens(called.usage) == counted.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=QUESTION)


# ---- usage as Anthropic counts it --------------------------------------------------------------------------------

LONG_SYSTEM = ("You answer questions about arithmetic for a small workshop. Every answer is a single line, with the "
               "result first and then one short reason. Numbers are written in digits, never in words. ") * 4


def test_usage_splits_the_prompt_into_computed_and_cached_tokens(claude, llm):
    """input_tokens counts only what was computed: input + cache_read + cache_creation is the prompt's length, in a
    whole reply and in a stream's message_start and message_delta; a second request sharing a long prefix reads it
    from the cache."""
    def prompt_length(question: str) -> int:  # the prompt rendered independently of the server
        messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]
        return len(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    first = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=LONG_SYSTEM,
                                   messages=[{"role": "user", "content": "What is 3 + 4?"}])
    assert prompt_tokens(first.usage) == prompt_length("What is 3 + 4?")
    second = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, system=LONG_SYSTEM,
                                    messages=[{"role": "user", "content": "What is 9 - 5?"}])
    usage = second.usage
    assert usage.cache_read_input_tokens > 100 and usage.cache_creation_input_tokens == 0 and usage.input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens \
        == prompt_length("What is 9 - 5?")
    with claude.messages.stream(model=MODEL, max_tokens=4, extra_body=GREEDY, system=LONG_SYSTEM,
                                messages=[{"role": "user", "content": "What is 8 * 2?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    for counted in (start, delta, final.usage):
        assert counted.cache_read_input_tokens > 100 and counted.input_tokens > 0
        assert prompt_tokens(counted) == prompt_length("What is 8 * 2?")
    assert delta.output_tokens == final.usage.output_tokens > 0


# ---- prefill: a final assistant message is continued ---------------------------------------------------------------

PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]


def test_prefill_continues_the_final_assistant_message(claude, server):
    """The reply continues the prefilled text and holds only the continuation: greedy, it is what the engine
    generates from transformers' own rendering of the conversation with continue_final_message."""
    hf = transformers.AutoTokenizer.from_pretrained(str(AGENT_DEMO))
    prompt = hf.apply_chat_template(PREFILL, continue_final_message=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    expected = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    reply = claude.messages.create(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=PREFILL)
    assert prompt_tokens(reply.usage) == expected.usage.prompt_tokens == len(hf(prompt, add_special_tokens=False)
                                                                             ["input_ids"])
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == expected.choices[0].text
    assert not reply.content[0].text.startswith("The capital")
    with claude.messages.stream(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=PREFILL) as stream:
        assert stream.get_final_message().content[0].text == expected.choices[0].text
    assert claude.messages.count_tokens(model=MODEL, messages=PREFILL).input_tokens == expected.usage.prompt_tokens


def test_prefill_edge_cases(claude):
    question = PREFILL[:1]
    with pytest.raises(anthropic.BadRequestError) as err:  # Anthropic's own rule
        claude.messages.create(model=MODEL, max_tokens=4, messages=[*question, {"role": "assistant",
                                                                                 "content": "The capital is "}])
    assert err.value.body["error"]["message"] == \
        "messages[1]: final assistant content cannot end with trailing whitespace"
    # an empty final assistant message is no prefill: the reply starts the turn, as without it
    empty = claude.messages.count_tokens(model=MODEL, messages=[*question, {"role": "assistant", "content": ""}])
    assert empty.input_tokens == claude.messages.count_tokens(model=MODEL, messages=question).input_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, tools=TOOLS, messages=[*question, {
            "role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                              "input": {"expression": "1 + 1"}}]}])
    assert err.value.body["error"]["message"].startswith("messages[1]: a final assistant message is continued")


# ---- content blocks: thinking in history, text only, server tools, readable errors ---------------------------------


def test_thinking_blocks_in_history_are_rendered_as_the_template_renders_reasoning(claude, llm):
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "They greet me.", "signature": "s"},
                                                 {"type": "redacted_thinking", "data": "EuYBCkQYAiJA"},
                                                 {"type": "text", "text": "Hello!"}]},
               {"role": "user", "content": "What is 2 + 2?"}]
    as_template = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet me."},
                   {"role": "user", "content": "What is 2 + 2?"}]
    expected = llm.tokenizer.apply_chat_template(as_template, add_generation_prompt=True, tokenize=False)
    assert "<think>\nThey greet me.\n</think>" in expected  # the agent-demo template renders reasoning
    counted = claude.messages.count_tokens(model=MODEL, messages=history).input_tokens
    assert counted == len(llm.tokenizer.encode(expected))
    reply = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=history)
    assert prompt_tokens(reply.usage) == counted
    without = [history[0], {"role": "assistant", "content": "Hello!"}, history[2]]
    assert claude.messages.count_tokens(model=MODEL, messages=without).input_tokens < counted


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a note"}}


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}],
     "this model reads text only: image block at messages[0].content[1]"),
    ([{"role": "user", "content": [DOCUMENT]}], "this model reads text only: document block at messages[0].content[0]"),
    ([*QUESTION, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                                    "input": {"expression": "37 * 12"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}],
     "this model reads text only: image block at messages[2].content[0].content[0]"),
    ([{"role": "user", "content": [{"type": "hologram", "text": "x"}]}],
     "messages[0].content[0]: unknown content block type 'hologram'; this server takes text, tool_use, tool_result, "
     "thinking, redacted_thinking blocks"),
    ([{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}],
     "messages[0].content[0]: search_result blocks (Anthropic's server tools and their results) are not supported "
     "by this server"),
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}],
     "messages[0].content[0]: thinking blocks belong in assistant messages, not user ones"),
])
def test_blocks_this_server_cannot_read_are_one_readable_400(claude, messages, message):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, messages=messages)
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.count_tokens(model=MODEL, messages=messages)
    assert err.value.body["error"]["message"] == message


def test_server_tools_are_refused_by_name(claude):
    for tool in ({"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
                 {"type": "bash_20250124", "name": "bash"},
                 {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}):
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, tools=[*TOOLS, tool])
        assert err.value.body["error"]["message"].startswith(
            f"server tool {tool['type']} is not supported by this server (tools[1])")
    custom = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=QUESTION,
                                    tools=[{**TOOLS[0], "type": "custom"}], tool_choice={"type": "none"})
    assert custom.usage.output_tokens > 0


READABLE = re.compile(r"^(body|[a-z_]+(\[\d+\]|\.[a-z_]+)*): [^\n]+$")


@pytest.mark.parametrize("fields, where", [
    ({"max_tokens": 4, "messages": QUESTION, "system": 5}, "system"),
    ({"max_tokens": 4, "messages": QUESTION, "system": [{"type": "text"}]}, "system[0].text"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": ["f"]}, "tools[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 7}]}]}, "messages[0].content[0].content"),
    ({"max_tokens": "many", "messages": QUESTION, "temperature": "hot"}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
])
def test_every_validation_error_is_one_message_naming_its_field(server, fields, where):
    status, text = http("POST", f"{server.url}/v1/messages", {"model": MODEL, **fields})
    error = json.loads(text)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error", text
    message = error["error"]["message"]
    assert message.startswith(f"{where}: ") and READABLE.match(message), message
    assert not re.search(r"list\[|dict\[|Block|function-|union", message), message  # no pydantic union dump


def test_explicit_nulls_are_fields_left_out(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": None, "system": None, "tools": None,
            "tool_choice": None, "temperature": 0, "top_p": None, "stop_sequences": None, "thinking": None}
    status, text = http("POST", f"{server.url}/v1/messages", body)
    assert status == 200 and json.loads(text)["usage"]["output_tokens"] > 0, text
    status, text = http("POST", f"{server.url}/v1/messages", {**body, "max_tokens": None})
    assert status == 400 and json.loads(text)["error"]["message"].startswith("max_tokens: "), text


# ---- admission before rendering ------------------------------------------------------------------------------------


def test_the_lease_is_taken_before_rendering_and_released_on_every_path(make_server, llm, aengine, monkeypatch):
    """/v1/messages and /v1/messages/count_tokens render inside the server's admission bound: at its limit both are
    429s before any rendering; every way out (a reply, a 400 after rendering, a failed render) gives the place back."""
    server = make_server(max_queued_requests=1)
    state = server.state
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    seen, render = [], llm.tokenizer.apply_chat_template

    def watched(*args, **kwargs):
        seen.append(state.in_flight)
        return render(*args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", watched)
    assert claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=QUESTION)
    claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=PREFILL)
    assert seen and set(seen) == {1}  # every rendering ran holding the request's place
    assert state.in_flight == 0

    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story"}],
                                         max_tokens=800, temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # generating: the stream holds the only place
    seen.clear()
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.count_tokens(model=MODEL, messages=QUESTION)
    with pytest.raises(anthropic.RateLimitError):  # refused before its (too long) prompt was rendered
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x " * 5000}])
    assert seen == []
    stream.close()
    server.served.wait("/v1/chat/completions", 1)  # its place given back
    assert state.in_flight == 0

    with pytest.raises(anthropic.BadRequestError):  # rendered, then refused: the place is given back
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x " * 5000}])
    assert state.in_flight == 0
    broken = threading.Event()

    def failing(*args, **kwargs):
        broken.set()
        raise RuntimeError("template engine exploded")

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", failing)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, _ = http("POST", f"{server.url}{path}", {"model": MODEL, "max_tokens": 4, "messages": QUESTION})
        assert status == 500 and broken.is_set() and state.in_flight == 0
    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", render)
    assert claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0
    assert wait_blocks_free(aengine)["used"] == 0
