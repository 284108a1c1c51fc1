"""API conversations under the history policy (issue 40), with the official `openai` client against a real server on
loopback serving a tiny thinking model (thinking_model.py: the Qwen3 family's template, which drops the reasoning of
replies before the last user message; every reply thinks, then calls a tool).

A tool loop (a question, a call, a ~2,000-token tool result, a second call, its short result) then a follow-up user
message: under `preserve` (the default) the follow-up continues from the exact ids the engine computed for the loop,
so nearly all of it comes from the prefix cache, whether the client kept the reasoning (inline or as
`reasoning_content`) or dropped it, and its answer (tokens and logprobs) is the one a fresh engine computes for the
same prompt ids. Under `template` the template's rendering drops the loop's reasoning and most of the loop is computed
again. A request that continues no stored conversation is rendered as sent."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import openai
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL as DEMO_MODEL
from tests.server.conftest import Served, http
from tests.server.thinking_model import ARGUMENTS, REASONING, REPLY_CONTENT, TOOL, TOOLS, make_thinking_model
from tsterm import LLM, SamplingParams
from tsterm.chat.history import PRESERVE, TEMPLATE
from tsterm.engine.async_engine import AsyncEngine
from tsterm.server.app import create_app
from tsterm.server.conversations import ConversationStore, message_key
from tsterm.server.serve import BackgroundServer, build_state

MODEL = "thinking"
BLOCK = 16  # the engine's default block size: the prefix cache serves whole blocks
FOLLOW_UP = "Thanks. And 7*8?"
LONG_RESULT = " ".join(f"Tide table line {i}: high water at {i % 12 + 1}:{i * 7 % 60:02d}, low water six hours later."
                       for i in range(42))


class Recorder:
    """The request observer: every finished request's info (policy applied, prompt ids) and last output."""

    def __init__(self):
        self.done: list[tuple] = []
        self.lock = threading.Lock()

    def started(self, info):
        pass

    def progress(self, info, output):
        pass

    def finished(self, info, output, error):
        with self.lock:
            self.done.append((info, output))

    def last(self):
        with self.lock:
            return self.done[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def served(model_dir):
    llm = LLM(str(model_dir), device="cpu")
    aengine = AsyncEngine(llm.engine)
    state = build_state(aengine, MODEL)
    state.observer = Recorder()
    server = BackgroundServer(Served(create_app(state))).start()
    server.state, server.llm = state, llm
    yield server
    server.stop()
    aengine.shutdown()
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def scratch(model_dir):
    """The same model on an engine without a prefix cache: every prompt computed from its first token."""
    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=False)
    yield llm
    llm.engine.shutdown()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def assistant(choice, keep: str) -> dict:
    """The assistant message a client sends back: reasoning inline as returned, moved to `reasoning_content`, or
    dropped; its tool-call arguments re-serialised (indented) as some clients do."""
    message = choice.message
    content = message.content or ""
    reasoning, _, answer = content.rpartition("</think>")
    out = {"role": "assistant", "content": content if keep == "inline" else answer.lstrip("\n"),
           "tool_calls": [{"id": c.id, "type": "function",
                           "function": {"name": c.function.name,
                                        "arguments": json.dumps(json.loads(c.function.arguments), indent=1)}}
                          for c in message.tool_calls or []]}
    if keep == "field":
        out["reasoning_content"] = reasoning.removeprefix("<think>").strip("\n")
    return out


@dataclass
class Loop:
    messages: list[dict]  # the client's history after the loop, follow-up included
    loop_ids: list[int]  # the exact ids of the loop's last request: its prompt + its reply
    follow_up: object  # the follow-up's ChatCompletion
    info: object  # the follow-up's RequestInfo


def run_loop(client, served, task: str, keep: str, kwargs: dict | None = None, follow_up_kwargs: dict | None = None,
             **follow_up_options) -> Loop:
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    messages = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": task}]
    for result in (LONG_RESULT, "Done."):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                               max_tokens=16, extra_body=extra)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == REPLY_CONTENT
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (TOOL, ARGUMENTS)
        messages += [assistant(choice, keep), {"role": "tool", "tool_call_id": call.id, "content": result}]
        info, output = served.state.observer.last()
        loop_ids = list(info.prompt_ids) + list(output.outputs[0].token_ids)
    messages.append({"role": "user", "content": FOLLOW_UP})
    extra = {"chat_template_kwargs": follow_up_kwargs} if follow_up_kwargs else extra
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16,
                                           logprobs=True, top_logprobs=3, extra_body=extra, **follow_up_options)
    info, _ = served.state.observer.last()
    return Loop(messages, loop_ids, reply, info)


def as_template(messages: list[dict]) -> list[dict]:
    """The client's messages as the server hands them to the template: tool-call arguments parsed."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def ideal(ids: list[int]) -> int:
    """The loop's prompt as the prefix cache can serve it: its whole blocks."""
    return len(ids) // BLOCK * BLOCK


@pytest.mark.parametrize("keep", ["inline", "field", "dropped"])
def test_a_follow_up_after_a_tool_loop_reuses_the_loop_and_answers_as_a_fresh_engine(client, served, scratch, keep):
    loop = run_loop(client, served, f"Read the tides document ({keep}).", keep)
    assert len(loop.loop_ids) > 2000
    assert loop.info.history_policy == PRESERVE and loop.info.history_fallback is None
    prompt = list(loop.info.prompt_ids)
    assert prompt[:len(loop.loop_ids)] == loop.loop_ids  # the loop's exact ids, its reasoning included
    tokenizer = served.llm.tokenizer
    assert tokenizer.decode(prompt[len(loop.loop_ids):], skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nDone.\n</tool_response><|im_end|>\n"
        f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n")
    usage = loop.follow_up.usage
    assert usage.prompt_tokens == len(prompt)
    cached = usage.prompt_tokens_details.cached_tokens
    print(f"[{keep}] loop {len(loop.loop_ids)} ids (ideal {ideal(loop.loop_ids)}), follow-up prompt "
          f"{usage.prompt_tokens}, cached {cached}")
    assert cached >= 0.95 * ideal(loop.loop_ids)

    # the answer is the one an engine without any cache computes for the same prompt ids, logprobs included
    fresh = scratch.generate([prompt], SamplingParams(temperature=0, max_tokens=16, logprobs=3))[0].outputs[0]
    served_logprobs = [(t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
                       for t in loop.follow_up.choices[0].logprobs.content]
    fresh_logprobs = [(e["logprob"], [(tokenizer.decode([i], skip_special_tokens=False), lp) for i, lp in e["top"]])
                      for e in fresh.logprobs]
    assert served_logprobs == fresh_logprobs
    assert usage.completion_tokens == len(fresh.token_ids)


def test_template_renders_as_the_template_says_and_computes_the_loop_again(client, served):
    kwargs = {"thinking_history": TEMPLATE}
    loop = run_loop(client, served, "Read the tides document (template).", "inline", kwargs)
    assert loop.info.history_policy == TEMPLATE and loop.info.history_fallback is None
    tokenizer = served.llm.tokenizer
    rendered = tokenizer.apply_chat_template(as_template(loop.messages), tools=TOOLS, add_generation_prompt=True)
    assert list(loop.info.prompt_ids) == tokenizer.encode(rendered)  # as sent
    assert REASONING not in rendered  # the template dropped the loop's reasoning ...
    cached = loop.follow_up.usage.prompt_tokens_details.cached_tokens
    print(f"[template] loop {len(loop.loop_ids)} ids, follow-up cached {cached}")
    assert cached < 0.5 * ideal(loop.loop_ids)  # ... so the loop after its first reply is computed again


def test_the_request_may_choose_preserve_over_a_template_default(client, served):
    """`thinking_history` on the follow-up alone decides its policy."""
    loop = run_loop(client, served, "Read the tides document (switch).", "dropped", {"thinking_history": TEMPLATE},
                    {"thinking_history": PRESERVE})
    assert loop.info.history_policy == PRESERVE
    assert loop.follow_up.usage.prompt_tokens_details.cached_tokens >= 0.95 * ideal(loop.loop_ids)


def test_a_request_that_continues_nothing_is_rendered_as_sent(client, served):
    loop = run_loop(client, served, "Read the tides document (other system).", "inline")
    metrics_before = scrape(served)
    other = [{"role": "system", "content": "You are a terse agent."}, *loop.messages[1:]]
    client.chat.completions.create(model=MODEL, messages=other, tools=TOOLS, temperature=0, max_tokens=16)
    info, _ = served.state.observer.last()
    assert info.history_policy is None and info.history_fallback is None
    tokenizer = served.llm.tokenizer
    rendered = tokenizer.apply_chat_template(as_template(other), tools=TOOLS, add_generation_prompt=True)
    assert list(info.prompt_ids) == tokenizer.encode(rendered)
    assert scrape(served)["tsterm:server_history_unmatched_total"] == \
        metrics_before["tsterm:server_history_unmatched_total"] + 1

    # another client (its `user`) never continues this one's conversation
    client.chat.completions.create(model=MODEL, messages=loop.messages, tools=TOOLS, temperature=0, max_tokens=16,
                                   user="someone-else")
    assert served.state.observer.last()[0].history_policy is None


def scrape(served) -> dict:
    status, text = http("GET", f"{served.url}/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_and_log_count_each_policy_and_each_fallback(client, served, caplog):
    before = scrape(served)
    run_loop(client, served, "Read the tides document (metrics).", "field")
    # a reply cut by max_tokens does not end with the stop token: its continuation falls back, and says why
    messages = [{"role": "user", "content": "Read the tides document (cut)."}]
    cut = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=2)
    assert cut.choices[0].finish_reason == "length"
    messages += [{"role": "assistant", "content": cut.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    with caplog.at_level(logging.INFO, logger="tsterm.server"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    info, _ = served.state.observer.last()
    assert info.history_policy == TEMPLATE and info.history_fallback.startswith("the last reply did not end with a stop")
    assert any("fell back to 'template'" in r.getMessage() and "max_tokens" in r.getMessage() for r in caplog.records)
    after = scrape(served)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('tsterm:server_history_policy_total{policy="preserve"}') == 2  # the loop's second call, the follow-up
    assert grew('tsterm:server_history_policy_total{policy="template"}') == 1
    assert grew('tsterm:server_history_fallbacks_total{reason="reply_cut"}') == 1
    assert after["tsterm:server_conversations"] >= 1


def test_n_choices_and_streaming_keep_the_conversation(client, served):
    """Every choice of an n > 1 request is stored: a client continues whichever it took; a streamed reply is stored
    as the client assembles it."""
    messages = [{"role": "system", "content": "You are a careful agent."},
                {"role": "user", "content": "Read the tides document (n=2)."}]
    stored = len(served.state.conversations)
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16,
                                           n=2)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    assert len(served.state.conversations) == stored + 2  # one conversation per choice
    call = reply.choices[1].message.tool_calls[0]
    messages += [assistant(reply.choices[1], "dropped"),
                 {"role": "tool", "tool_call_id": call.id, "content": LONG_RESULT}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16,
                                            stream=True)
    content, calls = "", {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                entry["arguments"] += delta.function.arguments or ""
    assert served.state.observer.last()[0].history_policy == PRESERVE
    loop_info, loop_out = served.state.observer.last()
    loop_ids = list(loop_info.prompt_ids) + list(loop_out.outputs[0].token_ids)
    messages += [{"role": "assistant", "content": content,
                  "tool_calls": [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]},
                 {"role": "user", "content": FOLLOW_UP}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    info, _ = served.state.observer.last()
    assert info.history_policy == PRESERVE and list(info.prompt_ids[:len(loop_ids)]) == loop_ids
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0.95 * ideal(loop_ids)


@pytest.mark.parametrize("kwargs, param", [
    ([1, 2], "chat_template_kwargs"),
    ({"thinking_history": "keep"}, "chat_template_kwargs.thinking_history"),
    ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking"),
    ({"preserve_thinking": 1}, "chat_template_kwargs.preserve_thinking"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
])
def test_chat_template_kwargs_errors_name_the_field(served, kwargs, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    status, text = http("POST", f"{served.url}/v1/chat/completions", body)
    assert status == 400
    error = json.loads(text)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.rpartition(".")[2] in error["message"]


def test_chat_template_kwargs_and_anthropic_thinking_reach_the_template(server):
    """The agent-demo template closes an empty <think> block when enable_thinking is false."""
    openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    def prompt_tokens(kwargs):
        extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
        reply = openai_client.chat.completions.create(model=DEMO_MODEL, messages=messages, max_tokens=1,
                                                      extra_body=extra)
        return reply.usage.prompt_tokens

    plain = prompt_tokens(None)
    assert prompt_tokens({"enable_thinking": True, "some_variable": {"a": [1]}}) == plain
    closed = prompt_tokens({"enable_thinking": False})
    assert closed > plain

    def count(thinking):
        body = {"model": DEMO_MODEL, "messages": messages, **({"thinking": thinking} if thinking else {})}
        status, text = http("POST", f"{server.url}/v1/messages/count_tokens", body)
        assert status == 200, text
        return json.loads(text)["input_tokens"]

    assert count(None) == count({"type": "enabled", "budget_tokens": 1024}) == plain
    assert count({"type": "disabled"}) == closed
    status, text = http("POST", f"{server.url}/v1/messages/count_tokens",
                        {"model": DEMO_MODEL, "messages": messages, "thinking": {"type": "sometimes"}})
    assert status == 400 and "thinking" in text


# ---- the store on its own --------------------------------------------------------------------------------------


def session_of(messages: list[dict], ids: list[int]):
    from tsterm.chat.session import Session

    session = Session(id="s", kind="api", messages=[dict(m) for m in messages])
    session.keep(ids, len(messages))
    return session


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_store_matches_modulo_reasoning_arguments_and_whitespace_and_is_bounded():
    clock = Clock()
    store = ConversationStore(max_conversations=2, ttl_s=10, clock=clock)
    history = [{"role": "user", "content": "Q"},
               {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [2]}}}]}]
    store.put("alice", session_of(history, [1, 2, 3]))
    sent = [{"role": "user", "content": "  Q\n"},
            {"role": "assistant", "content": "", "reasoning_content": "other reasoning", "tool_calls": [
                {"id": "renumbered", "type": "function", "function": {"name": "f", "arguments": '{"b": [2], "a": 1}'}}]},
            {"role": "tool", "content": "r"}]
    found = store.find("alice", sent)
    assert found is not None and found.token_ids == [1, 2, 3] and found.kept_messages == 2
    assert message_key(sent[1]) == message_key(history[1])
    assert store.find("bob", sent) is None  # another owner
    assert store.find("alice", sent[:2]) is None  # nothing new to add
    changed = [*sent[:1], {**sent[1], "tool_calls": [{"function": {"name": "f", "arguments": {"a": 2, "b": [2]}}}]},
               sent[2]]
    assert store.find("alice", changed) is None  # other arguments

    found.token_ids.append(9)  # a copy: the stored one does not change
    assert store.find("alice", sent).token_ids == [1, 2, 3]

    clock.now = 5
    store.put("alice", session_of([{"role": "user", "content": "P"}, {"role": "assistant", "content": "x"}], [4]))
    store.put("alice", session_of([{"role": "user", "content": "R"}, {"role": "assistant", "content": "y"}], [5]))
    assert len(store) == 2 and store.find("alice", sent) is None  # the oldest went first (count bound)
    clock.now = 14.9
    assert store.find("alice", [{"role": "user", "content": "R"}, {"role": "assistant", "content": "y"},
                                {"role": "user", "content": "z"}]) is not None  # found: stored again at 14.9
    clock.now = 24
    assert store.find("alice", [{"role": "user", "content": "P"}, {"role": "assistant", "content": "x"},
                                {"role": "user", "content": "z"}]) is None and len(store) == 1  # P aged out


def test_anthropic_messages_continue_a_stored_conversation_too(served):
    """The Messages API: a tool loop whose reasoning the client sends back as a thinking block, then a follow-up."""
    tools = [{"name": TOOL, "description": "Read a document by its name.",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "Read the tides document (anthropic)."}]

    def create(messages):
        body = {"model": MODEL, "max_tokens": 16, "system": "You are a careful agent.", "tools": tools,
                "messages": messages}
        status, text = http("POST", f"{served.url}/v1/messages", body, timeout=120)
        assert status == 200, text
        return json.loads(text)

    for result in (LONG_RESULT, "Done."):
        reply = create(messages)
        text, call = reply["content"]
        assert reply["stop_reason"] == "tool_use" and text["text"] == REPLY_CONTENT and call["input"] == ARGUMENTS
        sent = [{"type": "thinking", "thinking": REASONING.strip(), "signature": ""}, call]  # reasoning as a block
        messages += [{"role": "assistant", "content": sent},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}]}]
        info, output = served.state.observer.last()
        loop_ids = list(info.prompt_ids) + list(output.outputs[0].token_ids)
    messages[-1]["content"].append({"type": "text", "text": FOLLOW_UP})
    reply = create(messages)
    info, _ = served.state.observer.last()
    assert info.history_policy == PRESERVE and list(info.prompt_ids[:len(loop_ids)]) == loop_ids
    assert reply["usage"]["cache_read_input_tokens"] >= 0.95 * ideal(loop_ids)


def test_a_required_call_may_follow_reasoning_where_the_request_enables_thinking(client):
    """tool_choice "required" holds the reply to calls by a grammar; `enable_thinking: true` lets it open with a
    reasoning block first (the model's own chain: reasoning, then the call), otherwise the call comes first. One call
    allowed: the grammar ends after it (the random weights would go on with more)."""
    tools = [{"type": "function", "function": {"name": TOOL, "parameters": {  # a closed schema: the random weights
        "type": "object", "properties": {"name": {"enum": ["tides"]}}, "required": ["name"],  # write no more
        "additionalProperties": False}}}]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Read the tides document."}], tools=tools,
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    thinking = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    direct = client.chat.completions.create(**kwargs)
    for r in (thinking, direct):
        (call,) = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (TOOL, {"name": "tides"})
        assert r.choices[0].finish_reason == "tool_calls"
    assert thinking.choices[0].message.content == REPLY_CONTENT and direct.choices[0].message.content is None
