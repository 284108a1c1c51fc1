"""The Anthropic Messages API (`POST /v1/messages`) on a real server and engine (agent-demo on the CPU), driven by
the official `anthropic` client."""
from __future__ import annotations

import json

import anthropic
import pytest

from tests.server.conftest import MODEL, http, wait_blocks_free
from tsterm.agent.tools import Calculator

GREEDY = {"temperature": 0}  # this client version has no temperature argument: sent as an extra body field
QUESTION = [{"role": "user", "content": "What is 37 * 12?"}]
_SPEC = Calculator().spec()["function"]
TOOLS = [{"name": _SPEC["name"], "description": _SPEC["description"], "input_schema": _SPEC["parameters"]}]


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
    assert with_system.usage.input_tokens > plain.usage.input_tokens
    assert with_system.usage.input_tokens == as_string.usage.input_tokens


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
    assert counted.input_tokens == reply.usage.input_tokens > 0
    required = claude.messages.count_tokens(**kwargs, tool_choice={"type": "any"})
    called = claude.messages.create(max_tokens=40, extra_body=GREEDY, **kwargs, tool_choice={"type": "any"})
    assert called.stop_reason == "tool_use"  # held to a call by its grammar, which adds no prompt tokens
    assert required.input_tokens == called.usage.input_tokens == counted.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=QUESTION)
