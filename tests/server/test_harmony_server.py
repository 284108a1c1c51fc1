"""gpt-oss's harmony format through the server, with the official `openai` and `anthropic` clients on loopback: a tiny
gpt_oss checkpoint whose tokenizer speaks harmony, its replies scripted (tests/server/harmony_model.py). The analysis
channel comes back as `reasoning_content` (OpenAI) and thinking blocks (Anthropic), a `to=functions.NAME` message as a
tool call whose arguments stream as they arrive, the final channel as content; the prompt is tsterm's harmony rendering,
and a conversation's next request continues the model's own ids; tool_choice required / named / none hold the reply to
the allowed calls (the grammar handed to the engine) or render no tools."""
from __future__ import annotations

import anthropic
import llguidance
import openai
import pytest

from tests.server.harmony_model import ScriptedEngine, make_harmony_checkpoint
from tsterm import LLM
from tsterm.agent.harmony import HarmonyChat, render
from tsterm.agent.tool_grammar import ChatTokens
from tsterm.engine.async_engine import AsyncEngine
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state

MODEL = "gpt-oss-tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
REASONING = "The user wants the weather in Oslo; call get_weather."
ARGUMENTS = '{"city":"Oslo"}'
CALL = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>")
ANSWER = ("<|channel|>analysis<|message|>21 degrees, say so.<|end|><|start|>assistant<|channel|>final<|message|>"
          "It is 21 °C in Oslo.<|return|>")
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
DATE = {"conversation_start_date": "2025-06-28"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt_oss")
    llm = LLM(str(path), device="cpu")
    aengine = AsyncEngine(llm.engine)
    engine = ScriptedEngine(aengine)
    server = BackgroundServer(create_app(build_state(engine, MODEL))).start()
    yield engine, server
    server.stop()
    aengine.shutdown()
    llm.engine.shutdown()


@pytest.fixture
def engine(served):
    engine, _ = served
    engine.replies.clear()
    engine.prompts.clear()
    engine.params.clear()
    return engine


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served[1].url, api_key="none", max_retries=0)


def test_a_reply_s_reasoning_and_call_and_the_conversation_continues_the_model_s_ids(engine, client):
    tokenizer = engine.aengine.tokenizer
    engine.replies += [CALL, ANSWER]
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, extra_body={
        "chat_template_kwargs": DATE})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == REASONING
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)
    # the prompt is tsterm's harmony rendering (not the checkpoint's template)
    assert engine.prompts[0] == tokenizer.encode(render(USER, TOOLS, **DATE))

    reply_ids = tokenizer.encode(CALL)
    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, extra_body={
        "chat_template_kwargs": DATE})
    # the stored conversation's exact ids, then the tool result as harmony writes it
    assert engine.prompts[1] == engine.prompts[0] + reply_ids + tokenizer.encode(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}<|end|>'
        "<|start|>assistant")
    assert second.usage.prompt_tokens_details.cached_tokens >= len(engine.prompts[0]) // 16 * 16
    message = second.choices[0].message
    assert (message.content, message.reasoning_content) == ("It is 21 °C in Oslo.", "21 degrees, say so.")
    assert second.choices[0].finish_reason == "stop" and not message.tool_calls


def test_streamed_reasoning_content_and_call_arguments(engine, client):
    engine.replies.append(CALL)
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True)
    reasoning, content, starts, arguments, reasons = [], [], [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                reasoning.append(delta.reasoning_content)
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or []:
                if call.id:
                    starts.append((call.index, call.id, call.function.name))
                if call.function.arguments:
                    arguments.append(call.function.arguments)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(reasoning) == REASONING and len(reasoning) > 1  # streamed as it came
    assert not "".join(content).strip()
    assert [(i, name) for i, _, name in starts] == [(0, "get_weather")]
    assert "".join(arguments) == ARGUMENTS and len(arguments) > 1
    assert reasons == ["tool_calls"]


def test_anthropic_thinking_blocks_and_tool_use(engine, claude):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    engine.replies += [CALL, CALL, ANSWER]
    message = claude.messages.create(model=MODEL, max_tokens=200, messages=USER, tools=tools)
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[0].thinking == REASONING
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Oslo"})

    with claude.messages.stream(model=MODEL, max_tokens=200, messages=USER, tools=tools) as stream:
        thinking = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert "".join(thinking) == REASONING and len(thinking) > 1
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"

    answer = claude.messages.create(model=MODEL, max_tokens=200, tools=tools, messages=[
        *USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[1].id,
                                      "content": '{"celsius": 21}'}]}])
    assert [(b.type, getattr(b, "text", None)) for b in answer.content] == [("thinking", None),
                                                                            ("text", "It is 21 °C in Oslo.")]
    assert answer.stop_reason == "end_turn"


def _accepts(engine, grammar: str, text: str) -> bool:
    tokenizer = engine.aengine.tokenizer
    tokens = ChatTokens(tokenizer)
    matcher = llguidance.LLMatcher(tokens.lltokenizer, grammar)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def test_tool_choice_required_named_and_none(engine, client):
    engine.replies += [CALL, CALL, ANSWER]
    call, answer = CALL.removesuffix("<|call|>"), ANSWER.removesuffix("<|return|>")
    time_call = call.replace("get_weather", "get_time")

    client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required")
    grammar = engine.params[-1].structured_outputs.grammar
    assert _accepts(engine, grammar, call) and _accepts(engine, grammar, time_call)
    assert not _accepts(engine, grammar, answer)  # a call is required
    assert not _accepts(engine, grammar, call.replace(ARGUMENTS, '{"town":"Oslo"}'))  # held to the schema

    named = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    grammar = engine.params[-1].structured_outputs.grammar
    assert _accepts(engine, grammar, call) and not _accepts(engine, grammar, time_call)
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert named.choices[0].finish_reason == "tool_calls"

    none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert engine.params[-1].structured_outputs is None
    prompt = engine.aengine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "namespace functions" not in prompt  # no tools rendered
    assert none.choices[0].message.content == "It is 21 °C in Oslo."


def test_the_server_renders_harmony_and_detects_it_from_the_tokenizer(served):
    engine, _ = served
    state = build_state(engine, MODEL)
    assert isinstance(state.tokenizer, HarmonyChat)  # the vocabulary holds harmony's markers
    template = engine.aengine.tokenizer.apply_chat_template(USER, tools=TOOLS)
    rendered = state.tokenizer.apply_chat_template(USER, tools=TOOLS, **DATE)
    assert rendered == render(USER, TOOLS, **DATE) and rendered != template  # tsterm's renderer, not the template
