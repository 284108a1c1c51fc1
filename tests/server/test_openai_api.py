"""The OpenAI-compatible API on a real server and engine (agent-demo on the CPU), driven by the official client."""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, http, wait_blocks_free
from tsterm.agent.tools import Calculator

QUESTION = [{"role": "user", "content": "What is 37 * 12?"}]
TOOLS = [Calculator().spec()]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0,
                                       max_tokens=8)
    choice = r.choices[0]
    assert r.model == MODEL and r.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
                  temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_tool_call_round_trip_reuses_the_cache(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id
    assert json.loads(call.function.arguments) == {"expression": "37 * 12"}
    history = QUESTION + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "444"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert "444" in second.choices[0].message.content
    # the re-rendered history matches what the model emitted: the whole first turn comes from the cache
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // 16 * 16 > 0


def test_a_reply_of_tool_calls_only_has_null_content(server):
    status, body = http("POST", f"{server.url}/v1/chat/completions",
                        {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "temperature": 0})
    message = json.loads(body)["choices"][0]["message"]
    assert status == 200 and "content" in message and message["content"] is None and message["tool_calls"]


def test_streamed_tool_call(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "calculator"
    assert deltas[0].function.arguments == "" and all(d.index == 0 and d.id is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"expression": "37 * 12"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()


def test_tool_choice_none_offers_no_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=40)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


def test_tool_choice_named_and_required(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert r.choices[0].message.tool_calls[0].function.name == "calculator"
    # a greeting, which the model answers in text under "auto": "required" makes the reply a call
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], tools=TOOLS,
                                       tool_choice="required", temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == \
        "calculator"


def test_n_2_and_seeded_sampling(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], n=2,
                                       temperature=1.0, seed=3, max_tokens=10)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens > 10 or all(c.finish_reason == "stop" for c in r.choices)  # both counted
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], n=2,
                                           temperature=1.0, seed=3, max_tokens=10)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me"}],
                                                   n=2, temperature=1.0, seed=3, max_tokens=10, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [c.message.content for c in r.choices]


def test_stop_string(client):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0)
    full = client.chat.completions.create(**kwargs, tool_choice="none", max_tokens=30).choices[0].message.content
    assert len(full) > 4
    stop = full[3:5]
    cut = client.chat.completions.create(**kwargs, tool_choice="none", max_tokens=30, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0,
                                       max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best one was taken
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].logprobs.tokens) == 6 and "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    streamed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    status, body = http("GET", f"{server.url}/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "model": MODEL}


def test_metrics_parse_and_count(client, server):
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(http("GET", f"{server.url}/metrics")[1])}
    requests = {(s.labels["endpoint"], s.labels["status"]): s.value
                for s in families["tsterm:server_requests"].samples if s.name.endswith("_total")}
    assert requests[("/v1/chat/completions", "200")] >= 1
    assert families["tsterm:server_prompt_tokens"].samples[0].value > 0
    assert "tsterm:server_cached_prompt_tokens" in families
    assert families["tsterm:prefix_cache_queries"].samples[0].value > 0
    assert "tsterm:time_to_first_token_seconds" in families and "tsterm:kv_cache_usage_perc" in families


def test_blocks_are_free_after_requests(client, aengine):
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    assert wait_blocks_free(aengine)["used"] == 0


def test_several_calls_in_one_turn_split_across_deltas():
    from tsterm.server.tool_stream import CallArguments, CallStart, ReplyParser

    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>')
    parser = ReplyParser(TOOLS, parse=True)
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    content, starts, arguments = "", [], {}
    for n, piece in enumerate(pieces):
        for p in parser.feed(piece, final=n == len(pieces) - 1):
            if isinstance(p, str):
                content += p
            elif isinstance(p, CallStart):
                starts.append(p)
            elif isinstance(p, CallArguments):
                arguments[p.index] = arguments.get(p.index, "") + p.text
    assert content.strip() == "Let me compute."
    assert [json.loads(arguments[s.index]) for s in starts] == [{"expression": "1 + 2"}, {"expression": "3 * 4"}]
    assert len({s.id for s in starts}) == 2 and [s.index for s in starts] == [0, 1]
    assert [c.id for c in parser.calls] == [s.id for s in starts]
    other = ReplyParser(TOOLS, parse=True)
    other.feed(text, final=True)
    assert not {c.id for c in other.calls} & {s.id for s in starts}  # ids unique across turns
